package proxy

import (
	"strings"
	"testing"
)

// The client's model name comes back into an answer whatever the reads it arrives in: every
// split of the engine's bytes gives the same renamed answer, and text that only looks like
// the member (inside a string) is left alone.
func TestRenamerPutsTheAliasBackAcrossEverySplit(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"a JSON answer",
			`{"id":"c","model":"llama-3-70b","choices":[{"text":"hi"}]}`,
			`{"id":"c","model":"chat","choices":[{"text":"hi"}]}`},
		{"every event of a stream",
			"data: {\"model\":\"llama-3-70b\",\"x\":1}\n\ndata: {\"model\":\"llama-3-70b\",\"x\":2}\n\ndata: [DONE]\n\n",
			"data: {\"model\":\"chat\",\"x\":1}\n\ndata: {\"model\":\"chat\",\"x\":2}\n\ndata: [DONE]\n\n"},
		{"a Responses event, nested",
			"event: response.completed\ndata: {\"response\":{\"model\":\"llama-3-70b\"}}\n\n",
			"event: response.completed\ndata: {\"response\":{\"model\":\"chat\"}}\n\n"},
		{"generated text that quotes the member",
			`{"model":"llama-3-70b","text":"say \"model\":\"llama-3-70b\" please"}`,
			`{"model":"chat","text":"say \"model\":\"llama-3-70b\" please"}`},
		{"another model, and a prefix of the pattern at the end",
			`{"model":"llama-3-8b"} "model":"llama`,
			`{"model":"llama-3-8b"} "model":"llama`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for cut := 0; cut <= len(tc.in); cut++ {
				for cut2 := cut; cut2 <= len(tc.in); cut2 += 3 {
					r := newRenamer("llama-3-70b", "chat")
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
