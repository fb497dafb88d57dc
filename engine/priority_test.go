package engine

import (
	"encoding/json"
	"testing"
)

// TestEveryLegKeepsThePriority: vLLM's --scheduling-policy priority (and SGLang's priority
// scheduling) read the body's priority on each engine, so every body a request becomes
// carries the client's, as it came.
func TestEveryLegKeepsThePriority(t *testing.T) {
	for _, api := range []API{APICompletions, APIChat} {
		body := `{"model":"m","prompt":"hi","priority":-3,"max_tokens":9,"stream":true}`
		if api == APIChat {
			body = `{"model":"m","messages":[{"role":"user","content":"hi"}],"priority":-3,"max_tokens":9,"stream":true}`
		}
		f := parseFields(t, body)
		params := json.RawMessage(`{"remote_block_ids":[1]}`)
		bodies := map[string][]byte{}
		var err error
		if bodies["vllm prefill"], err = PrefillBody(f, api); err != nil {
			t.Fatal(err)
		}
		if bodies["vllm decode"], err = DecodeBody(f, params); err != nil {
			t.Fatal(err)
		}
		if bodies["vllm decode without params"], err = DecodeBody(f, nil); err != nil {
			t.Fatal(err)
		}
		if bodies["vllm drain"], err = DrainBody(f, api, params); err != nil {
			t.Fatal(err)
		}
		sg, err := SGLang.(interface {
			Legs(*Fields, Leg) (LegCalls, error)
		}).Legs(f, Leg{Host: "10.0.0.7", Port: 8998, Room: 7, RID: "r"})
		if err != nil {
			t.Fatal(err)
		}
		bodies["sglang prefill"], bodies["sglang decode"] = sg.Prefill, sg.Decode
		mc, err := Mooncake.(interface {
			Legs(*Fields, Leg) (LegCalls, error)
		}).Legs(f, Leg{Host: "10.0.0.7", Port: 8998, TransferID: "x", EngineID: "e", Rank: -1, API: api})
		if err != nil {
			t.Fatal(err)
		}
		bodies["mooncake prefill"], bodies["mooncake decode"], bodies["mooncake drain"] = mc.Prefill, mc.Decode, mc.Drain
		for name, b := range bodies {
			var m map[string]json.RawMessage
			if err := json.Unmarshal(b, &m); err != nil {
				t.Fatalf("api %d, %s: %v: %s", api, name, err, b)
			}
			if string(m["priority"]) != "-3" {
				t.Errorf("api %d, %s: priority %q, want -3: %s", api, name, m["priority"], b)
			}
		}
	}
}
