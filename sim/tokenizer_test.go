package sim

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/internal/hftok"
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

// testTokenizerFile is the small byte-level BPE shipped for tests (internal/hftok/testdata).
const testTokenizerFile = "../internal/hftok/testdata/tokenizer.json"

func TestWithATokenizerFileTheEngineTokenizesAndCachesByIt(t *testing.T) {
	hf, err := hftok.LoadFile(testTokenizerFile)
	if err != nil {
		t.Fatal(err)
	}
	cfg := fastConfig()
	cfg.Tokenizer = testTokenizerFile
	ts := startServer(t, cfg)
	tokenize := func(t *testing.T, body string) []uint32 {
		t.Helper()
		resp := ts.post(t, context.Background(), "/tokenize", body, nil)
		b := readAll(t, resp)
		var ans struct {
			Tokens []uint32 `json:"tokens"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &ans) != nil {
			t.Fatalf("/tokenize: status %d: %s", resp.StatusCode, b)
		}
		return ans.Tokens
	}
	system := strings.Repeat("You are a helpful assistant. ", 12)
	t.Run("a prompt's tokens are the file's, its post-processor's first", func(t *testing.T) {
		want, _ := hf.Encode("The capital of France is Paris.", true)
		if got := tokenize(t, `{"prompt":"The capital of France is Paris."}`); !slices.Equal(got, want) {
			t.Errorf("tokens %v, want %v", got, want)
		}
	})
	t.Run("a chat is ChatML rendered, then tokenized whole", func(t *testing.T) {
		want, _ := hf.Encode("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", false)
		if got := tokenize(t, `{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi there"}]}`); !slices.Equal(got, want) {
			t.Errorf("tokens %v, want %v", got, want)
		}
	})
	t.Run("a conversation's next turn hits the blocks of the one before", func(t *testing.T) {
		turn1 := `[{"role":"system","content":"` + system + `"},{"role":"user","content":"What is the capital of France?"}]`
		turn2 := `[{"role":"system","content":"` + system + `"},{"role":"user","content":"What is the capital of France?"},{"role":"assistant","content":"Paris."},{"role":"user","content":"And of Italy?"}]`
		first := tokenize(t, `{"messages":`+turn1+`}`)
		if next := tokenize(t, `{"messages":`+turn2+`}`); !slices.Equal(next[:len(first)], first) {
			t.Fatalf("turn 1's tokens %v are not a prefix of turn 2's %v", first, next)
		}
		answerUsage(t, ts, "/v1/chat/completions", `{"messages":`+turn1+`,"max_tokens":1}`, nil)
		u := answerUsage(t, ts, "/v1/chat/completions", `{"messages":`+turn2+`,"max_tokens":1}`, nil)
		if want := len(first) / 16 * 16; cachedTokens(u) != want {
			t.Errorf("cached %d tokens of turn 2, want turn 1's %d full blocks' %d", cachedTokens(u), len(first)/16, want)
		}
	})
}

func TestATokenizerFileThatCannotBeReadIsRefused(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "tokenizer.json")
	if err := os.WriteFile(bad, []byte(`{"model":{"type":"WordPiece","vocab":{"a":0}}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, file, want string }{
		{"a missing file", filepath.Join(t.TempDir(), "none.json"), "none.json"},
		{"a model the proxy cannot reproduce", bad, `"WordPiece": only BPE`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fastConfig()
			cfg.Tokenizer = tc.file
			e, err := New(cfg, nil)
			if err == nil {
				e.closeUnstarted()
				t.Fatal("New accepted it")
			}
			if !strings.Contains(err.Error(), "--tokenizer") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want --tokenizer and %q", err, tc.want)
			}
		})
	}
}
