package proxy

import (
	"net/http"
	"testing"
)

// vLLM's 2026 prefillers answer with fields older proxies never saw: NIXL connector version 5's
// remote_blocks_expiry_time (vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py,
// NIXL_CONNECTOR_VERSION 5) beside remote_num_tokens, transfer_mode, dcp_size and pp_size, and,
// with the offloading connector's P2P tier, its role keys remote_prefiller, remote_decoder and
// remote_kv_source (vllm/v1/kv_offload/tiering/p2p). The decoder must get them as the
// prefiller wrote them, every byte.
func TestADecoderGetsThePrefillersKVParamsOfEveryConnectorUntouched(t *testing.T) {
	tests := []struct{ name, params string }{
		{"NIXL connector version 5", `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3,4,5]],` +
			`"remote_engine_id":"p0","remote_request_id":"cmpl-p0-0","remote_host":"10.0.0.7","remote_port":5600,"tp_size":2,` +
			`"remote_num_tokens":40,"remote_blocks_expiry_time":1796517251.250000,"transfer_mode":"read","dcp_size":1,"pp_size":1}`},
		{"NIXL with the offloading connector's P2P keys", `{"do_remote_prefill":true,"remote_block_ids":[7,8],"remote_engine_id":"p0",` +
			`"remote_host":"10.0.0.7","remote_port":5600,"remote_prefiller":{"kv_request_id":"kq-2","remote_host":"10.0.0.3","remote_port":5710},` +
			`"remote_kv_source":{"kv_request_id":"kq-1","remote_host":"10.0.0.2","remote_port":5710}}`},
		{"the P2P tier's keys alone", `{"remote_prefiller":{"kv_request_id":"kq-9","remote_host":"10.0.0.3","remote_port":5710},` +
			`"remote_decoder":{"kv_request_id":"kq-9"}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newEngine(t, vllmPrefill(tt.params))
			d := newEngine(t, vllmDecode)
			h := pd(t, Config{}, p, d)
			resp, body := h.post("/v1/completions", `{"model":"m","prompt":"Hello there","max_tokens":8}`)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			if got := string(d.only(t, "decoder").fields(t)["kv_transfer_params"]); got != tt.params {
				t.Errorf("the decoder got kv_transfer_params\n%s\nwant the prefiller's\n%s", got, tt.params)
			}
			h.waitQuiet()
		})
	}
}
