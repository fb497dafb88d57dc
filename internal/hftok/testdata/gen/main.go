// Command gen writes testdata/tokenizer.json and testdata/tokenizer_config.json: a byte-level
// BPE trained on the text below (the most frequent adjacent pair merged, 400 times), with
// Llama 3's pre-tokenizing pattern, a <|begin_of_text|> that prompts begin with, and ChatML's
// <|im_start|> and <|im_end|> as special tokens and chat template. Run from the repository:
//
//	go run ./internal/hftok/testdata/gen
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"

	"github.com/dlclark/regexp2"
)

const corpus = `The proxy sends a request to the engine that already holds its prompt's longest prefix.
A prefiller computes the prompt's KV cache and holds it until a decoder has read it; the
decoder then generates the answer, token by token, and streams it to the client. When the
client goes away, the proxy aborts the work at once, whatever stage the request is in, and
makes sure every KV block held for it is released exactly once. You are a helpful assistant.
What is the capital of France? The capital of France is Paris. Tell me a story about a cat
who lived in a library and read every book on its shelves, one page at a time, 1234 pages.
User: hello! Assistant: Hi there, how can I help you today? Summarize the document below.
Don't stop; it's fine, we'll see. They're here, I'm sure, you've been there, he'd go.
def main():\n    print("hello, world")\n    return 0\n\nif __name__ == "__main__":\n    main()
`

// pattern is Llama 3's pre-tokenizing pattern.
const pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`

const merges = 400

const chatTemplate = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"

func byteChars() [256]string {
	var out [256]string
	next := 256
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			out[b] = string(rune(b))
			continue
		}
		out[b] = string(rune(next))
		next++
	}
	return out
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run() error {
	bc := byteChars()
	re := regexp2.MustCompile(pattern, regexp2.Unicode)
	var words [][]string
	text := strings.ReplaceAll(corpus, `\n`, "\n")
	for m, _ := re.FindStringMatch(text); m != nil; m, _ = re.FindNextMatch(m) {
		var w []string
		for _, b := range []byte(m.String()) {
			w = append(w, bc[b])
		}
		words = append(words, w)
	}
	vocab := map[string]int{}
	for b := 0; b < 256; b++ {
		vocab[bc[b]] = b
	}
	var ms [][2]string
	for len(ms) < merges {
		counts := map[[2]string]int{}
		for _, w := range words {
			for i := 0; i+1 < len(w); i++ {
				counts[[2]string{w[i], w[i+1]}]++
			}
		}
		var best [2]string
		n := 0
		keys := make([][2]string, 0, len(counts))
		for k := range counts {
			keys = append(keys, k)
		}
		sort.Slice(keys, func(i, j int) bool { return keys[i][0]+" "+keys[i][1] < keys[j][0]+" "+keys[j][1] })
		for _, k := range keys {
			if counts[k] > n {
				best, n = k, counts[k]
			}
		}
		if n < 2 {
			break
		}
		ms = append(ms, best)
		vocab[best[0]+best[1]] = len(vocab)
		for wi, w := range words {
			var out []string
			for i := 0; i < len(w); i++ {
				if i+1 < len(w) && w[i] == best[0] && w[i+1] == best[1] {
					out = append(out, best[0]+best[1])
					i++
					continue
				}
				out = append(out, w[i])
			}
			words[wi] = out
		}
	}
	type added struct {
		ID         int    `json:"id"`
		Content    string `json:"content"`
		SingleWord bool   `json:"single_word"`
		LStrip     bool   `json:"lstrip"`
		RStrip     bool   `json:"rstrip"`
		Normalized bool   `json:"normalized"`
		Special    bool   `json:"special"`
	}
	var addedTokens []added
	for _, s := range []string{"<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"} {
		addedTokens = append(addedTokens, added{ID: len(vocab) + len(addedTokens), Content: s, Special: true})
	}
	bos := addedTokens[0]
	mergeList := make([]string, len(ms))
	for i, m := range ms {
		mergeList[i] = m[0] + " " + m[1]
	}
	tj := map[string]any{
		"version":      "1.0",
		"truncation":   nil,
		"padding":      nil,
		"added_tokens": addedTokens,
		"normalizer":   nil,
		"pre_tokenizer": map[string]any{"type": "Sequence", "pretokenizers": []any{
			map[string]any{"type": "Split", "pattern": map[string]any{"Regex": pattern}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
		}},
		"post_processor": map[string]any{"type": "Sequence", "processors": []any{
			map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
			map[string]any{"type": "TemplateProcessing",
				"single": []any{
					map[string]any{"SpecialToken": map[string]any{"id": bos.Content, "type_id": 0}},
					map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}},
				},
				"pair":           []any{},
				"special_tokens": map[string]any{bos.Content: map[string]any{"id": bos.Content, "ids": []int{bos.ID}, "tokens": []string{bos.Content}}},
			},
		}},
		"decoder": map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
		"model": map[string]any{"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": nil,
			"end_of_word_suffix": nil, "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
			"vocab": vocab, "merges": mergeList},
	}
	data, err := json.MarshalIndent(tj, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile("internal/hftok/testdata/tokenizer.json", append(data, '\n'), 0o644); err != nil {
		return err
	}
	cfg := map[string]any{
		"bos_token":        "<|begin_of_text|>",
		"eos_token":        "<|im_end|>",
		"chat_template":    chatTemplate,
		"model_max_length": 8192,
		"tokenizer_class":  "PreTrainedTokenizerFast",
	}
	data, err = json.MarshalIndent(cfg, "", " ")
	if err != nil {
		return err
	}
	return os.WriteFile("internal/hftok/testdata/tokenizer_config.json", append(data, '\n'), 0o644)
}
