package api

import (
	"strings"
	"testing"
)

// The client's model name comes back into an answer whatever the reads it arrives in: every
// split of the engine's bytes gives the same renamed answer, and text that only looks like
// the member (inside a string) is left alone.
func TestRenamerPutsTheAliasBackAcrossEverySplit(t *testing.T) {
	for _, tc := range []struct{ name, served, in, want string }{
		{"a JSON answer", "",
			`{"id":"c","model":"llama-3-70b","choices":[{"text":"hi"}]}`,
			`{"id":"c","model":"chat","choices":[{"text":"hi"}]}`},
		{"every event of a stream", "",
			"data: {\"model\":\"llama-3-70b\",\"x\":1}\n\ndata: {\"model\":\"llama-3-70b\",\"x\":2}\n\ndata: [DONE]\n\n",
			"data: {\"model\":\"chat\",\"x\":1}\n\ndata: {\"model\":\"chat\",\"x\":2}\n\ndata: [DONE]\n\n"},
		{"a Responses event, nested", "",
			"event: response.completed\ndata: {\"response\":{\"model\":\"llama-3-70b\"}}\n\n",
			"event: response.completed\ndata: {\"response\":{\"model\":\"chat\"}}\n\n"},
		{"generated text that quotes the member", "",
			`{"model":"llama-3-70b","text":"say \"model\":\"llama-3-70b\" please"}`,
			`{"model":"chat","text":"say \"model\":\"llama-3-70b\" please"}`},
		{"another model, and a prefix of the pattern at the end", "",
			`{"model":"llama-3-8b"} "model":"llama`,
			`{"model":"llama-3-8b"} "model":"llama`},
		// vLLM (Python's json, pydantic) writes these characters raw; Go's encoding/json
		// escapes them. Either spelling is the served model's.
		{"a served name with &, <, >, U+2028 and U+2029, written raw", "a&b<c>\u2028\u2029",
			"data: {\"model\":\"a&b<c>\u2028\u2029\",\"x\":1}\n\ndata: {\"model\":\"a&b<c>\u2028\u2029\"}\n\n",
			"data: {\"model\":\"chat\",\"x\":1}\n\ndata: {\"model\":\"chat\"}\n\n"},
		{"a served name with &, <, >, U+2028 and U+2029, written escaped", "a&b<c>\u2028\u2029",
			`{"model":"a\u0026b\u003cc\u003e\u2028\u2029","text":"\u0026"}`,
			`{"model":"chat","text":"\u0026"}`},
		{"both spellings in one answer, and another model with the same characters", "a&b<c>",
			`{"model":"a&b<c>"} {"model":"a\u0026b\u003cc\u003e"} {"model":"a&b<d>"}`,
			`{"model":"chat"} {"model":"chat"} {"model":"a&b<d>"}`},
		{"an escaped backslash before what looks like an escape", `x\u0026`,
			`{"model":"x\\u0026"} {"model":"x&"}`,
			`{"model":"chat"} {"model":"x&"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for cut := 0; cut <= len(tc.in); cut++ {
				for cut2 := cut; cut2 <= len(tc.in); cut2 += 3 {
					served := tc.served
					if served == "" {
						served = "llama-3-70b"
					}
					r := NewRenamer(served, "chat")
					var out strings.Builder
					for _, part := range []string{tc.in[:cut], tc.in[cut:cut2], tc.in[cut2:]} {
						out.Write(r.rewrite([]byte(part)))
					}
					out.Write(r.flush())
					if out.String() != tc.want {
						t.Fatalf("reads split at %d and %d: %q, want %q", cut, cut2, out.String(), tc.want)
					}
				}
			}
		})
	}
}
