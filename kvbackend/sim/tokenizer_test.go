package sim

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

func TestTokensOfATextArePrefixOfTheTokensOfItsExtensionAtAWordEnd(t *testing.T) {
	tests := []struct {
		name, text, more string
	}{
		{"a sentence extended by a sentence", "The quick brown fox", " jumps over the lazy dog."},
		{"a long word extended", strings.Repeat("abcdefg", 9), " and more"},
		{"multibyte words", "héllo wörld ✓✓✓", "\n\tnext línea"},
		{"punctuation", "Hello, world!", "  How are you?"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b := promptTokens(tt.text), promptTokens(tt.text+tt.more)
			if len(b) <= len(a) || !slices.Equal(b[:len(a)], a) {
				t.Errorf("tokens(%q) = %v are not a proper prefix of tokens(%q) = %v", tt.text, a, tt.text+tt.more, b)
			}
		})
	}
}

func TestAConversationsNextTurnExtendsThePreviousTurnsTokens(t *testing.T) {
	turn1 := []ChatMessage{{"system", "You are terse."}, {"user", "What is KV caching?"}}
	turn2 := append(slices.Clone(turn1), ChatMessage{"assistant", " tok123 tok456"}, ChatMessage{"user", "And prefix caching?"})
	a, b := TokenizeChat(turn1, true), TokenizeChat(turn2, true)
	if len(b) <= len(a) || !slices.Equal(b[:len(a)], a) {
		t.Errorf("turn 1's tokens %v are not a prefix of turn 2's %v", a, b)
	}
	if c := TokenizeChat(turn1, false); !slices.Equal(a[:len(c)], c) || len(a) != len(c)+5 {
		t.Errorf("without the generation prompt %v, want %v less its last 5 tokens", c, a)
	}
}

func TestTokenizeAnswersTheCountTheEngineReports(t *testing.T) {
	ts := startServer(t, fastConfig())
	long := strings.Repeat("lorem ipsum dolor sit amet ", 20)
	tests := []struct {
		name, tokenize, path, body string
	}{
		{"a text prompt", `{"model":"sim","prompt":"` + long + `"}`, "/v1/completions", `{"prompt":"` + long + `","max_tokens":1}`},
		{"an empty prompt counts one token", `{"prompt":""}`, "/v1/completions", `{"prompt":"","max_tokens":1}`},
		{"chat messages through the template", `{"model":"sim","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"` + long + `"}]}`,
			"/v1/chat/completions", `{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"` + long + `"}],"max_tokens":1}`},
		{"chat without the generation prompt", `{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}`,
			"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false,"max_tokens":1}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), "/tokenize", tt.tokenize, nil)
			var tok struct {
				Count       int      `json:"count"`
				MaxModelLen int      `json:"max_model_len"`
				Tokens      []uint32 `json:"tokens"`
			}
			if b := readAll(t, resp); resp.StatusCode != http.StatusOK || json.Unmarshal(b, &tok) != nil {
				t.Fatalf("/tokenize: status %d: %s", resp.StatusCode, b)
			}
			if tok.Count != len(tok.Tokens) || tok.Count < 1 || tok.MaxModelLen != 64*16 {
				t.Errorf("/tokenize = %+v, want count = len(tokens) >= 1 and max_model_len %d", tok, 64*16)
			}
			resp = ts.post(t, context.Background(), tt.path, tt.body, nil)
			var ans struct {
				Usage usage `json:"usage"`
			}
			if b := readAll(t, resp); resp.StatusCode != http.StatusOK || json.Unmarshal(b, &ans) != nil {
				t.Fatalf("%s: status %d: %s", tt.path, resp.StatusCode, b)
			}
			if ans.Usage.PromptTokens != tok.Count {
				t.Errorf("usage.prompt_tokens = %d, /tokenize counts %d", ans.Usage.PromptTokens, tok.Count)
			}
		})
	}
	t.Run("a prompt that is not a string is a 400", func(t *testing.T) {
		resp := ts.post(t, context.Background(), "/tokenize", `{"prompt":42}`, nil)
		if b := readAll(t, resp); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("status %d: %s, want 400", resp.StatusCode, b)
		}
	})
}

// FuzzTokenizer checks that any text tokenizes into ids of the vocabulary,
// at least one, and that extending a text ending at a word end by text
// starting with whitespace extends its tokens.
func FuzzTokenizer(f *testing.F) {
	f.Add("hello world", " and more")
	f.Add("", "x")
	f.Add("\xff\xfe", " \xc3")
	f.Add("ünïcødé✓", "\u00a0nbsp")
	f.Fuzz(func(t *testing.T, text, more string) {
		toks := promptTokens(text)
		if len(toks) == 0 || len(toks) > max(len(text), 1) {
			t.Fatalf("tokens(%q) = %d tokens", text, len(toks))
		}
		for _, id := range toks {
			if id >= vocabSize || (id < firstTextToken && id != tokenBOS) {
				t.Fatalf("tokens(%q) has id %d outside the vocabulary", text, id)
			}
		}
		last, _ := utf8.DecodeLastRuneInString(text)
		first, _ := utf8.DecodeRuneInString(more)
		if text == "" || more == "" || unicode.IsSpace(last) || !unicode.IsSpace(first) || !utf8.ValidString(text+more) {
			return
		}
		ext := promptTokens(text + more)
		if len(ext) <= len(toks) || !slices.Equal(ext[:len(toks)], toks) {
			t.Fatalf("tokens(%q) = %v, not a prefix of tokens(%q) = %v", text, toks, text+more, ext)
		}
	})
}
