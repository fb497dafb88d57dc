package engine

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
)

func TestMooncakeLegs(t *testing.T) {
	for _, tc := range []struct {
		name string
		body string
		api  API
	}{
		{"completion", `{"model":"m","prompt":"hi","max_tokens":9,"stream":true,"stream_options":{"include_usage":true},"kv_transfer_params":{"evil":1}}`, APICompletions},
		{"chat", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9,"stream":true}`, APIChat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := parseFields(t, tc.body)
			calls, err := Mooncake.Legs(f, Leg{Host: "10.0.0.7", Port: 8998, TransferID: "xfer-1", EngineID: "eng-r1", Rank: 1, API: tc.api})
			if err != nil {
				t.Fatal(err)
			}
			var pre, dec map[string]json.RawMessage
			json.Unmarshal(calls.Prefill, &pre)
			json.Unmarshal(calls.Decode, &dec)
			wantPre := `{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-1"}`
			wantDec := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_bootstrap_addr":"http://10.0.0.7:8998","remote_engine_id":"eng-r1","remote_dp_rank":1,"transfer_id":"xfer-1"}`
			if string(pre["kv_transfer_params"]) != wantPre || string(pre["stream"]) != "false" || string(pre["max_tokens"]) != "1" {
				t.Errorf("prefill leg %s", calls.Prefill)
			}
			if tc.api == APIChat && string(pre["max_completion_tokens"]) != "1" {
				t.Errorf("chat prefill leg keeps max_completion_tokens: %s", calls.Prefill)
			}
			if _, ok := pre["stream_options"]; ok {
				t.Errorf("prefill leg keeps stream_options: %s", calls.Prefill)
			}
			if string(dec["kv_transfer_params"]) != wantDec || string(dec["stream"]) != "true" {
				t.Errorf("decode leg %s", calls.Decode)
			}
			if calls.PrefillHeader.Get("X-data-parallel-rank") != "1" {
				t.Errorf("prefill header %v, want rank 1", calls.PrefillHeader)
			}
		})
	}
	if _, err := Mooncake.Legs(parseFields(t, `{"model":"m","prompt":"hi"}`), Leg{Host: "h", Port: 1, Rank: -1}); err == nil {
		t.Error("legs without a transfer id or engine id were built")
	}
}

func TestMooncakeBootstrapReadsEachRanksEngineID(t *testing.T) {
	for _, tc := range []struct {
		name    string
		status  int
		body    string
		want    map[int]string
		errPart string
	}{
		{"two ranks", 200, `{"0":{"engine_id":"a","tp_size":1},"1":{"engine_id":"b"}}`, map[int]string{0: "a", 1: "b"}, ""},
		{"an older vLLM", 404, `not found`, nil, "older"},
		{"not a map of ranks", 200, `{"engine_id":"a"}`, nil, "rank"},
		{"no rank", 200, `{}`, nil, "no rank"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/query" {
					http.NotFound(w, r)
					return
				}
				w.WriteHeader(tc.status)
				w.Write([]byte(tc.body))
			}))
			defer srv.Close()
			u, _ := url.Parse(srv.URL)
			port, _ := strconv.Atoi(u.Port())
			bs, err := Mooncake.Bootstrap(testCtx(t), srv.Client(), "http://"+u.Host, port)
			if tc.errPart != "" {
				if err == nil || !strings.Contains(err.Error(), tc.errPart) {
					t.Fatalf("error %v, want one saying %q", err, tc.errPart)
				}
				return
			}
			if err != nil || bs.Port != port || len(bs.EngineIDs) != len(tc.want) {
				t.Fatalf("Bootstrap = %+v, %v", bs, err)
			}
			for r, id := range tc.want {
				if bs.EngineIDs[r] != id {
					t.Errorf("rank %d: %q, want %q", r, bs.EngineIDs[r], id)
				}
			}
		})
	}
}
