package app

import (
	"bytes"
	"encoding/json"
	"slices"
	"testing"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/internal/hftok"
)

// refMessages is what plainMessages must agree with: encoding/json reading the same array,
// unknown fields refused.
func refMessages(raw []byte) ([]hftok.Message, bool) {
	var in []struct {
		Role    string  `json:"role"`
		Content *string `json:"content"`
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil || len(in) == 0 || dec.More() {
		return nil, false
	}
	out := make([]hftok.Message, len(in))
	for i, m := range in {
		if m.Role == "" || m.Content == nil {
			return nil, false
		}
		out[i] = hftok.Message{Role: m.Role, Content: *m.Content}
	}
	return out, true
}

func msg(role, content string) hftok.Message { return hftok.Message{Role: role, Content: content} }

func TestPlainMessagesReadsWhatEveryJSONReaderReadsTheSameWay(t *testing.T) {
	for _, tc := range []struct {
		raw  string
		want []hftok.Message // nil: left to the engine
	}{
		{`[{"role":"user","content":"hi"}]`, []hftok.Message{msg("user", "hi")}},
		{" [ {\"content\" : \"a\\nb\\u00e9\\ud83d\\ude00\\\"\\\\\\/\\t\" ,\n\"role\":\"system\"} , {\"role\":\"user\",\"content\":\"\"} ] \n",
			[]hftok.Message{msg("system", "a\nbé😀\"\\/\t"), msg("user", "")}},
		{`[{"role":"user","content":"東京 🙂"}]`, []hftok.Message{msg("user", "東京 🙂")}},
		{`[]`, nil},
		{`[{"role":"user"}]`, nil},
		{`[{"role":"","content":"x"}]`, nil},
		{`[{"role":"user","content":null}]`, nil},
		{`[{"role":"user","content":[{"type":"text","text":"hi"}]}]`, nil},
		{`[{"role":"user","content":"hi","name":"bob"}]`, nil},
		{`[{"Role":"user","content":"hi"}]`, nil},                 // encoding/json would take it; an engine would not
		{`[{"role":"user","role":"system","content":"hi"}]`, nil}, // which role is it?
		{`[{"role":"user","content":"\ud83d"}]`, nil},             // a lone surrogate
		{`[{"role":"user","content":"\ude00\ud83d"}]`, nil},       // reversed
		{"[{\"role\":\"user\",\"content\":\"\xff\"}]", nil},       // invalid UTF-8
		{"[{\"role\":\"user\",\"content\":\"a\\n\xff\"}]", nil},   // after an escape too
		{"[{\"role\":\"user\",\"content\":\"a\nb\"}]", nil},       // a raw control character
		{`[{"role":"user","content":"\x41"}]`, nil},               // no such escape
		{`[{"role":"user","content":"\u00g0"}]`, nil},
		{`[{"role":"user","content":"hi"}] x`, nil},
		{`[{"role":"user","content":"hi"},]`, nil},
		{`[{"role":"user","content":"hi",}]`, nil},
		{`[{"role":"user","content":"hi"}`, nil},
		{`[{"role":"user","content":"hi`, nil},
		{`[{"role":"user","content":"hi\`, nil},
		{`[{"role":"user","content":"\u12`, nil},
		{`{"role":"user","content":"hi"}`, nil},
		{``, nil},
	} {
		got, ok := plainMessages([]byte(tc.raw))
		if ok != (tc.want != nil) || !slices.Equal(got, tc.want) {
			t.Errorf("%q: %q %v, want %q", tc.raw, got, ok, tc.want)
		}
		if ok {
			if ref, rok := refMessages([]byte(tc.raw)); !rok || !slices.Equal(ref, got) {
				t.Errorf("%q: encoding/json reads %q %v", tc.raw, ref, rok)
			}
		}
	}
}

// FuzzPlainMessages: what plainMessages reads, encoding/json reads the same; and every array
// of plain messages encoding/json writes, plainMessages reads.
func FuzzPlainMessages(f *testing.F) {
	f.Add([]byte(`[{"role":"user","content":"hi"}]`), "system", "a\u2028b\x00\"\\é😀")
	f.Add([]byte("[{\"content\":\"\\ud83d\\ude00\",\"role\":\"u\"}]"), "user", "<|im_end|>\n")
	f.Fuzz(func(t *testing.T, raw []byte, role, content string) {
		if got, ok := plainMessages(raw); ok {
			if ref, rok := refMessages(raw); !rok || !slices.Equal(ref, got) {
				t.Fatalf("%q: read %q, encoding/json %q %v", raw, got, ref, rok)
			}
		}
		if role == "" || !utf8.ValidString(role) || !utf8.ValidString(content) {
			return
		}
		msgs := []map[string]string{{"role": role, "content": content}, {"content": content + role, "role": "assistant"}}
		b, err := json.Marshal(msgs)
		if err != nil {
			t.Fatal(err)
		}
		want := []hftok.Message{msg(role, content), msg("assistant", content+role)}
		if got, ok := plainMessages(b); !ok || !slices.Equal(got, want) {
			t.Fatalf("%s: read %q %v, want %q", b, got, ok, want)
		}
	})
}
