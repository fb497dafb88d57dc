package api

import (
	"strings"
	"testing"
)

func TestARequestsCacheKeyIsReadFromItsBody(t *testing.T) {
	img := `{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}`
	tests := []struct {
		name      string
		parse     func([]byte) (*Request, *Error)
		body      string
		salt      string
		media     bool
		wantParam string // the param of a 400, "" for none
	}{
		{"a completion's cache_salt", ParseCompletions, `{"model":"m","prompt":"hi","cache_salt":"tenant-a"}`, "tenant-a", false, ""},
		{"a chat's cache_salt", ParseChat, `{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":"t"}`, "t", false, ""},
		{"a null cache_salt is none", ParseCompletions, `{"model":"m","prompt":"hi","cache_salt":null}`, "", false, ""},
		{"a cache_salt that is no string is refused", ParseCompletions, `{"model":"m","prompt":"hi","cache_salt":7}`, "", false, "cache_salt"},
		{"text parts only", ParseChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`, "", false, ""},
		{"an image part", ParseChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"},` + img + `]}]}`, "", true, ""},
		{"an audio part in a later message", ParseChat, `{"model":"m","messages":[{"role":"user","content":"hi"},` +
			`{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]}]}`, "", true, ""},
		{"prompt embeddings", ParseCompletions, `{"model":"m","prompt":"","prompt_embeds":"AAAA"}`, "", true, ""},
		{"a Messages request's image", ParseMessages, `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":[` +
			`{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}},{"type":"text","text":"what is it?"}]}]}`, "", true, ""},
		{"a Responses input image", ParseResponses, `{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hi"},` +
			`{"type":"input_image","image_url":"https://example.com/a.png"}]}]}`, "", true, ""},
		{"a Responses text input", ParseResponses, `{"model":"m","input":"hi","cache_salt":"s"}`, "s", false, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, e := tt.parse([]byte(tt.body))
			if tt.wantParam != "" {
				if e == nil || e.Param != tt.wantParam {
					t.Fatalf("error %+v, want a 400 of param %s", e, tt.wantParam)
				}
				return
			}
			if e != nil {
				t.Fatalf("parse: %+v", e)
			}
			if req.Key.Salt != tt.salt || req.Key.Media != tt.media {
				t.Errorf("salt %q, media %v; want %q, %v", req.Key.Salt, req.Key.Media, tt.salt, tt.media)
			}
		})
	}
}

func TestRouteTextKeepsIdentitiesApartAndPlainTextAsItIs(t *testing.T) {
	text := `[{"role":"user","content":"the same conversation"}]`
	if got := RouteText(text, cacheKey{}); got != text {
		t.Errorf("a request of no LoRA and no salt routes on %q, want its text", got)
	}
	keys := []cacheKey{{LoRA: "ad"}, {Salt: "a"}, {Salt: "b"}, {LoRA: "ad", Salt: "a"}, {LoRA: "a", Salt: "d"}}
	seen := map[string]cacheKey{text[:1]: {}}
	for _, k := range keys {
		got := RouteText(text, k)
		if !strings.HasSuffix(got, text) || len(got) != len(text)+8 {
			t.Errorf("%+v: %q is not the text behind an 8-byte tag", k, got)
		}
		if other, dup := seen[got[:1]]; dup {
			t.Errorf("%+v and %+v route on texts of the same first byte: a tree would credit one's to the other", k, other)
		}
		seen[got[:1]] = k
		if RouteText(text, k) != got {
			t.Errorf("%+v: the tag is not the same from request to request", k)
		}
	}
}

// A conversation's request says where its last messages end in its text: the text its
// earlier request sent, the array as it was, ends at one of them, however the contents nest
// or quote brackets. A text that is no array, or not a whole one, has none; only the last 5
// are kept.
func TestAConversationsTurnEndsAreWhereItsEarlierRequestsTextEnds(t *testing.T) {
	earlier := `[{"role":"system","content":"be brief [really] {always}"},{"role":"user","content":"a \"quoted\" ] brace }"}`
	later := earlier + `,{"role":"assistant","content":[{"type":"text","text":"ok"}]},{"role":"tool","content":"{\"x\":[1,2]}"}]`
	req, e := ParseChat([]byte(`{"model":"m","messages":` + later + `}`))
	if e != nil {
		t.Fatal(e)
	}
	if len(req.TurnEnds) != 4 {
		t.Fatalf("turn ends %v of a 4-message chat", req.TurnEnds)
	}
	if got := req.Text[:req.TurnEnds[1]]; got != earlier {
		t.Errorf("the text up to the second message's end is %q, want the earlier request's %q", got, earlier)
	}
	if req.TurnEnds[3] != len(req.Text)-1 {
		t.Errorf("the last message ends at %d, want %d, before the array's end", req.TurnEnds[3], len(req.Text)-1)
	}
	msgs, _ := ParseMessages([]byte(`{"model":"m","max_tokens":4,"system":"sys","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":"more"}]}`))
	if msgs == nil || len(msgs.TurnEnds) != 4 || msgs.TurnEnds[3] != len(msgs.Text)-1 {
		t.Errorf("a Messages request's rendered conversation: turn ends %v of %q", msgs.TurnEnds, msgs.Text)
	}
	var many strings.Builder
	many.WriteString("[")
	for i := range 40 {
		if i > 0 {
			many.WriteString(",")
		}
		many.WriteString(`{"role":"user","content":"m"}`)
	}
	many.WriteString("]")
	if got := messageEnds(many.String(), maxTurnEnds); len(got) != maxTurnEnds || got[maxTurnEnds-1] != many.Len()-1 {
		t.Errorf("40 messages: ends %v, want the last %d", got, maxTurnEnds)
	}
	for _, text := range []string{"", "a prompt", `[{"role":"user"`, `{"a":1}`} {
		if got := messageEnds(text, maxTurnEnds); got != nil {
			t.Errorf("messageEnds(%q) = %v, want none", text, got)
		}
	}
}
