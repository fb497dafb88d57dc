package hftok

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/dlclark/regexp2"

	controlstructures "github.com/nikolalohinski/gonja/v2/builtins/control_structures"
	"github.com/nikolalohinski/gonja/v2/nodes"
)

const (
	testTokenizer = "testdata/tokenizer.json"
	testConfig    = "testdata/tokenizer_config.json"
)

func loadTest(t testing.TB) *Tokenizer {
	t.Helper()
	tk, err := LoadFile(testTokenizer)
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// decoder maps ids back to bytes through the file's vocab, as a detokenizer would.
func decoder(t testing.TB) map[uint32]string {
	t.Helper()
	data, err := os.ReadFile(testTokenizer)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		AddedTokens []struct {
			ID      uint32 `json:"id"`
			Content string `json:"content"`
		} `json:"added_tokens"`
		Model struct {
			Vocab map[string]uint32 `json:"vocab"`
		} `json:"model"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatal(err)
	}
	charByte := map[rune]byte{}
	for b, c := range byteChars {
		r, _ := utf8.DecodeRuneInString(c)
		charByte[r] = byte(b)
	}
	out := map[uint32]string{}
	for tok, id := range f.Model.Vocab {
		var b []byte
		for _, r := range tok {
			b = append(b, charByte[r])
		}
		out[id] = string(b)
	}
	for _, a := range f.AddedTokens {
		out[a.ID] = a.Content
	}
	return out
}

func decode(dec map[uint32]string, ids []uint32) string {
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(dec[id])
	}
	return b.String()
}

func TestEncode(t *testing.T) {
	tk := loadTest(t)
	dec := decoder(t)
	bos, _ := tk.SpecialToken("<|begin_of_text|>")
	imStart, _ := tk.SpecialToken("<|im_start|>")
	imEnd, _ := tk.SpecialToken("<|im_end|>")
	for _, tc := range []struct {
		name, text string
		special    bool
		check      func(t *testing.T, ids []uint32)
	}{
		{"a prompt begins with the post-processor's token", "The capital of France", true, func(t *testing.T, ids []uint32) {
			if ids[0] != bos || slices.Contains(ids[1:], bos) {
				t.Errorf("ids %v: want one %d first", ids, bos)
			}
		}},
		{"without special tokens nothing is added", "The capital of France", false, func(t *testing.T, ids []uint32) {
			if slices.Contains(ids, bos) {
				t.Errorf("ids %v hold the bos %d", ids, bos)
			}
		}},
		{"frequent words merge into fewer tokens than bytes", "The capital of France is Paris.", false, func(t *testing.T, ids []uint32) {
			if len(ids) >= len("The capital of France is Paris.")/2 {
				t.Errorf("%d tokens for %d bytes: the merges did not apply", len(ids), len("The capital of France is Paris."))
			}
		}},
		{"special tokens in the text are one token each", "<|im_start|>user\nhi<|im_end|>\n", false, func(t *testing.T, ids []uint32) {
			if ids[0] != imStart || !slices.Contains(ids, imEnd) {
				t.Errorf("ids %v: want %d first and %d inside", ids, imStart, imEnd)
			}
		}},
		{"an unfinished special token is text", "<|im_sta", false, func(t *testing.T, ids []uint32) {
			if slices.Contains(ids, imStart) {
				t.Errorf("ids %v hold %d", ids, imStart)
			}
		}},
		{"bytes outside the corpus still encode", "naïve 東京 🙂 \x00\t\r\n", false, nil},
		{"the empty text is no token", "", false, func(t *testing.T, ids []uint32) {
			// A tokenizer's first encoding too, before it has buffers to reuse.
			first, err := loadTest(t).Encode("", false)
			for _, ids := range [][]uint32{ids, first} {
				if err != nil || ids == nil || len(ids) != 0 {
					t.Errorf("ids %#v, %v: want an empty list (JSON [], not null)", ids, err)
				}
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ids, err := tk.Encode(tc.text, tc.special)
			if err != nil {
				t.Fatal(err)
			}
			got := decode(dec, ids)
			if tc.special {
				got = strings.TrimPrefix(got, "<|begin_of_text|>")
			}
			if got != tc.text {
				t.Errorf("decoded %q, want %q (ids %v)", got, tc.text, ids)
			}
			if tc.check != nil {
				tc.check(t, ids)
			}
		})
	}
}

// FuzzEncode: every text's tokens decode to the text, and a text cut where the next part
// starts with a line break (a chat turn's boundary) tokenizes as a prefix of the whole.
func FuzzEncode(f *testing.F) {
	tk := loadTest(f)
	dec := decoder(f)
	for _, s := range []string{"hello world", "The capital of France is Paris.", "  a\n\n b ", "don't WE'LL 12345", "<|im_end|>x", "東京\u2028x"} {
		f.Add(s, "<|im_end|>\n<|im_start|>user\nand more")
	}
	f.Fuzz(func(t *testing.T, text, more string) {
		if !utf8.ValidString(text) || !utf8.ValidString(more) {
			return
		}
		ids, err := tk.Encode(text, false)
		if err != nil {
			t.Fatal(err)
		}
		if got := decode(dec, ids); got != text {
			t.Fatalf("%q decoded as %q", text, got)
		}
		if !strings.HasPrefix(more, "<|im_end|>") || strings.HasSuffix(text, "<|im_") {
			return
		}
		whole, err := tk.Encode(text+more, false)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(whole[:len(ids)], ids) {
			t.Fatalf("%q: tokens %v are not a prefix of %q's %v", text, ids, text+more, whole)
		}
	})
}

// FuzzSplitLlama3 holds the hand-written matchers of Llama 3's and Qwen 2's patterns to
// the patterns run by a regular expression engine with lookahead.
func FuzzSplitLlama3(f *testing.F) {
	for _, s := range []string{"Hello world", "  two  spaces \n\n", "it's 2024's, WE'LL ok 1234567", " !! ?? \r\n\n x", "a\u00a0b\u3000 c", "x'", "' s", "tab\there ", " \n \t\n  y", "\t.\nz"} {
		f.Add(s)
	}
	type matcher struct {
		re    *regexp2.Regexp
		split llama3Split
	}
	matchers := []matcher{
		{regexp2.MustCompile(llama3Pattern, regexp2.Unicode), llama3Split{maxDigits: 3}},
		{regexp2.MustCompile(qwen2Pattern, regexp2.Unicode), llama3Split{maxDigits: 1}},
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return
		}
		for _, m := range matchers {
			got, _ := m.split.split(nil, s)
			want, err := regexSplit{re: m.re}.split(nil, s)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("%q, digits %d: split %q, the pattern %q", s, m.split.maxDigits, got, want)
			}
		}
	})
}

// gpt2Pattern is what splitGPT2 matches by hand.
const gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`

// FuzzSplitGPT2 holds the hand-written matcher to the pattern run by a regular expression
// engine with lookahead.
func FuzzSplitGPT2(f *testing.F) {
	re := regexp2.MustCompile(gpt2Pattern, regexp2.Unicode)
	for _, s := range []string{"Hello world", "  two  spaces \n\n", "it's 2024's, we'll ok", " !! ?? ", "a\u00a0b\u3000 c", "x'", "' s", "tab\there "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return
		}
		got := splitGPT2(nil, s)
		want, err := regexSplit{re: re}.split(nil, s)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%q: split %q, the pattern %q", s, got, want)
		}
	})
}

func TestLoadRefuses(t *testing.T) {
	base, err := os.ReadFile(testTokenizer)
	if err != nil {
		t.Fatal(err)
	}
	edit := func(f func(m map[string]any)) string {
		var m map[string]any
		if err := json.Unmarshal(base, &m); err != nil {
			t.Fatal(err)
		}
		f(m)
		out, _ := json.Marshal(m)
		return string(out)
	}
	model := func(m map[string]any) map[string]any { return m["model"].(map[string]any) }
	for _, tc := range []struct {
		name, file, want string
	}{
		{"not JSON", "{", "not a tokenizer.json"},
		{"no model", `{"added_tokens": []}`, "no model"},
		{"a WordPiece model", edit(func(m map[string]any) { model(m)["type"] = "WordPiece" }), `"WordPiece": only BPE`},
		{"SentencePiece-style byte fallback", edit(func(m map[string]any) { model(m)["byte_fallback"] = true }), "byte_fallback"},
		{"dropout", edit(func(m map[string]any) { model(m)["dropout"] = 0.1 }), "dropout"},
		{"a byte missing from the vocab", edit(func(m map[string]any) { delete(model(m)["vocab"].(map[string]any), "Ġ") }), "byte 0x20"},
		{"a merge of tokens not in the vocab", edit(func(m map[string]any) { model(m)["merges"] = []any{"zz qq"} }), `merges[0] "zz" "qq"`},
		{"a malformed merge", edit(func(m map[string]any) { model(m)["merges"] = []any{"abc"} }), "merges[0]"},
		{"a Metaspace pre-tokenizer", edit(func(m map[string]any) { m["pre_tokenizer"] = map[string]any{"type": "Metaspace"} }), `"Metaspace" is not supported`},
		{"no ByteLevel step", edit(func(m map[string]any) {
			m["pre_tokenizer"] = map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `\s+`}, "behavior": "Isolated"}
		}), "no ByteLevel"},
		{"a pattern that does not compile", edit(func(m map[string]any) {
			m["pre_tokenizer"] = map[string]any{"type": "Sequence", "pretokenizers": []any{
				map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `(`}, "behavior": "Isolated"},
				map[string]any{"type": "ByteLevel"}}}
		}), `pretokenizers[0]: type "Split": pattern`},
		{"an added token with lstrip", edit(func(m map[string]any) {
			m["added_tokens"] = []any{map[string]any{"id": 400, "content": "<x>", "lstrip": true}}
		}), `added_tokens[0] "<x>": single_word, lstrip and rstrip`},
		{"an unknown normalizer", edit(func(m map[string]any) { m["normalizer"] = map[string]any{"type": "Precompiled"} }), `normalizer: type "Precompiled"`},
		{"a BERT post-processor", edit(func(m map[string]any) { m["post_processor"] = map[string]any{"type": "BertProcessing"} }), `post_processor: type "BertProcessing"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "tokenizer.json")
			if err := os.WriteFile(path, []byte(tc.file), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := LoadFile(path)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
				t.Fatalf("error %v, want one naming %s and saying %q", err, path, tc.want)
			}
		})
	}
	t.Run("a missing file", func(t *testing.T) {
		if _, err := LoadFile(filepath.Join(t.TempDir(), "none.json")); err == nil || !strings.Contains(err.Error(), "none.json") {
			t.Fatalf("error %v", err)
		}
	})
}

func TestTemplate(t *testing.T) {
	tpl, err := LoadTemplate(testConfig)
	if err != nil {
		t.Fatal(err)
	}
	msgs := []Message{{"system", "Be brief."}, {"user", "hi"}, {"assistant", "hello"}, {"user", "and?"}}
	for _, tc := range []struct {
		name   string
		addGen bool
		want   string
	}{
		{"ChatML with the assistant's turn opened", true, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"},
		{"ChatML without it", false, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nand?<|im_end|>\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tpl.Render(msgs, tc.addGen)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("rendered %q, want %q", got, tc.want)
			}
		})
	}
	t.Run("what templates need: bos_token, loops, trimmed blocks (as Jinja2 renders them) and raise_exception", func(t *testing.T) {
		tpl, err := ParseTemplate("{{ bos_token }}\n{% for m in messages %}\n  {% if m['role'] == 'tool' %}{{ raise_exception('no tools: ' + m['role']) }}{% endif %}\n[{{ loop.index0 }}:{{ m['content'] | trim }}]\n{% endfor %}\n{% if add_generation_prompt %}>{% endif %}", "<s>", "</s>")
		if err != nil {
			t.Fatal(err)
		}
		got, err := tpl.Render([]Message{{"user", " a "}, {"assistant", "b"}}, true)
		if want := "<s>\n[0:a]\n[1:b]\n>"; err != nil || got != want {
			t.Errorf("rendered %q, %v; want %q", got, err, want)
		}
		if _, err := tpl.Render([]Message{{"tool", "x"}}, false); err == nil || !strings.Contains(err.Error(), "no tools: tool") {
			t.Errorf("error %v, want the template's own", err)
		}
	})
	t.Run("AppendRender writes Render's text after what the buffer holds", func(t *testing.T) {
		want, _ := tpl.Render(msgs, true)
		got, err := tpl.AppendRender([]byte("kept:"), msgs, true)
		if err != nil || string(got) != "kept:"+want {
			t.Errorf("AppendRender %q, %v; want %q after the buffer's bytes", got, err, want)
		}
	})
	t.Run("a config without a template is refused", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "tokenizer_config.json")
		_ = os.WriteFile(path, []byte(`{"bos_token": "<s>"}`), 0o644)
		if _, err := LoadTemplate(path); err == nil || !strings.Contains(err.Error(), "no chat_template") {
			t.Errorf("error %v", err)
		}
	})
	t.Run("a template that does not parse is refused", func(t *testing.T) {
		if _, err := ParseTemplate("{% for m in messages %}", "", ""); err == nil {
			t.Error("no error")
		}
	})
}

// AppendEncode leaves the buffer's tokens as they are and appends Encode's after them.
func TestAppendEncodeAppendsEncodesTokens(t *testing.T) {
	tk := loadTest(t)
	for _, add := range []bool{true, false} {
		text := "<|im_start|>user\nThe capital of France is Paris.<|im_end|>"
		want, err := tk.Encode(text, add)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tk.AppendEncode([]uint32{7, 8, 9}, text, add)
		if err != nil || !slices.Equal(got, append([]uint32{7, 8, 9}, want...)) {
			t.Errorf("special tokens %v: AppendEncode %v, %v; want 7 8 9 then %v", add, got, err, want)
		}
	}
}

// One Tokenizer and one Template serve every request at once.
func TestConcurrentUseGivesEachCallerItsOwnAnswer(t *testing.T) {
	tk := loadTest(t)
	tpl, err := LoadTemplate(testConfig)
	if err != nil {
		t.Fatal(err)
	}
	texts := []string{"The capital of France is Paris.", "def main():\n    return 0\n", "東京 🙂 it's 1234"}
	var want [][]uint32
	for _, s := range texts {
		r, _ := tpl.Render([]Message{{"user", s}}, true)
		ids, _ := tk.Encode(r, false)
		want = append(want, ids)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 50 {
				k := (g + i) % len(texts)
				r, err := tpl.Render([]Message{{"user", texts[k]}}, true)
				if err != nil {
					t.Error(err)
					return
				}
				ids, err := tk.Encode(r, false)
				if err != nil || !slices.Equal(ids, want[k]) {
					t.Errorf("%q: %v, %v; want %v", texts[k], ids, err, want[k])
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestAPatternThatBacktracksWithoutEndFailsTheTextInsteadOfHoldingIt(t *testing.T) {
	base, err := os.ReadFile(testTokenizer)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(base, &m); err != nil {
		t.Fatal(err)
	}
	// Nested repetition that cannot match the end: exponential backtracking on a long run.
	m["pre_tokenizer"] = map[string]any{"type": "Sequence", "pretokenizers": []any{
		map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `(a+)+b`}, "behavior": "Isolated"},
		map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}}}
	file, _ := json.Marshal(m)
	tok, err := Load(file)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tok.Encode("ab aab", false); err != nil {
		t.Fatalf("a text the pattern matches at once: %v", err)
	}
	text := strings.Repeat("a", 64) + "!"
	_, err = tok.Encode(text, false)
	if err == nil {
		t.Fatal("a text the pattern cannot match without backtracking for ever was encoded")
	}
	// The match was given up at its bound, splitMatchTimeout, rather than run to its end
	// (2^64 steps): the text held its caller that long at most.
	if want := "timed out after " + splitMatchTimeout.String(); !strings.Contains(err.Error(), want) {
		t.Errorf("Encode: %v; want it to say %q", err, want)
	}
	if strings.Contains(err.Error(), text) {
		t.Errorf("Encode: %v; the error quotes the client's text", err)
	}
}

// A sum of strings in a template's output is written term by term (splitConcatenations):
// every template renders as it does written whole, errors included.
func TestSumsOfStringsRenderAsWrittenWhole(t *testing.T) {
	cfg, err := os.ReadFile(testConfig)
	if err != nil {
		t.Fatal(err)
	}
	chatML, _, _, err := fromTokenizerConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	templates := map[string]string{
		"ChatML":                            chatML,
		"Llama 3 (a sum set, then written)": "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
		"numbers added":                     "{% for m in messages %}{{ loop.index + 1 }}:{{ loop.index + loop.index0 + 1 }}{{ m['content'] + '|' + loop.index | string }}{% endfor %}",
		"conditional outputs":               "{% for m in messages %}{{ '<' + m['role'] + '>' if m['role'] != 'system' else '[' + m['content'] + ']' }}{{ m['content'] + '.' if loop.last }}{% endfor %}",
		"a macro":                           "{% macro turn(r, c) %}{{ '<' + r + '>' + c + '</' + r + '>' }}{% endmacro %}{% for m in messages %}{{ turn(m['role'], m['content']) }}{% endfor %}",
		"if, elif, else and for's else":     "{% for m in messages if m['role'] != 'tool' %}{% if m['role'] == 'system' %}{{ '<<SYS>>' + m['content'] + '<</SYS>>' }}{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% else %}{{ 'none' + '!' }}{% endfor %}",
		"filters, parentheses, ~ and trims": "{%- for m in messages -%}\n  {{- ('<' + m['role']) + ('>' + m['content'] | upper) -}}\n  {{ '{' ~ m['role'] ~ '}' + '\\n' }}\n{%- endfor %}",
		"a sum that fails":                  "{% for m in messages %}{{ m['content'] + loop.index + 'x' }}{% endfor %}",
		"raise_exception of a sum":          "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no ' + m['role'] + ' messages') }}{% endif %}{{ m['content'] + '\\n' }}{% endfor %}",
	}
	convs := [][]Message{
		{{"system", "Be brief."}, {"user", " hi "}, {"assistant", "hello"}},
		{{"user", "東京 🙂 {{ not a tag }} 100%"}},
		{{"tool", "x"}},
		{},
	}
	render := func(src string, keep bool, msgs []Message) (string, error) {
		tpl, err := parseTemplate(src, "<s>", "</s>", !keep)
		if err != nil {
			t.Fatal(err)
		}
		return tpl.Render(msgs, true)
	}
	for name, src := range templates {
		t.Run(name, func(t *testing.T) {
			for _, msgs := range convs {
				want, werr := render(src, true, msgs)
				got, err := render(src, false, msgs)
				if got != want || (err == nil) != (werr == nil) {
					t.Errorf("%q: rendered %q, %v; written whole %q, %v", msgs, got, err, want, werr)
				}
			}
		})
	}
	t.Run("ChatML's sum is split", func(t *testing.T) {
		tpl, err := ParseTemplate(chatML, "", "")
		if err != nil {
			t.Fatal(err)
		}
		outputs := 0
		for _, n := range tpl.tpl.Root().Nodes {
			if b, ok := n.(*nodes.ControlStructureBlock); ok {
				if f, ok := b.ControlStructure.(*controlstructures.ForControlStructure); ok {
					outputs += len(f.BodyWrapper.Nodes)
				}
			}
		}
		if outputs != 6 {
			t.Errorf("the loop writes %d outputs, want the sum's 6 terms", outputs)
		}
	})
}
