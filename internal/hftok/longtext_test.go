package hftok

import (
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// allocated is what f allocates on the heap in all, and what more the heap holds after it,
// once collected, than before (a scratch the tokenizer kept, say).
func allocated(f func()) (total, kept int64) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	total = int64(after.TotalAlloc - before.TotalAlloc)
	runtime.GC()
	runtime.ReadMemStats(&after)
	return total, int64(after.HeapAlloc) - int64(before.HeapAlloc)
}

// letterMerges is a tokenizer whose merges make tokens of 2, 4 and 8 a's, with Llama 3's
// pre-tokenizer: a run of a's is one word, and its merge keeps every byte of it busy.
func letterMerges(t testing.TB) *Tokenizer {
	t.Helper()
	pre := map[string]any{"type": "Sequence", "pretokenizers": []any{
		map[string]any{"type": "Split", "pattern": map[string]any{"Regex": llama3Pattern}, "behavior": "Isolated"},
		map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}}}
	tk, err := Load(bpeFile(t, [][2]string{{"a", "a"}, {"aa", "aa"}, {"aaaa", "aaaa"}}, pre, false))
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// longTexts are prompts of n bytes (8,000,000 fit a request body of the default 10 MiB
// limit): one word each (a run of spaces, a run of a letter that merges), and words of two
// letters.
func longTexts(t testing.TB, n int) []struct {
	name string
	tk   *Tokenizer
	text string
	// tokens is how many the text has, each one token: one, or the next.
	tokens    int
	one, next string
} {
	return []struct {
		name      string
		tk        *Tokenizer
		text      string
		tokens    int
		one, next string
	}{
		{"spaces", loadTest(t), strings.Repeat(" ", n), n / 2, "  ", "  "},
		{"a's, merged by eights", letterMerges(t), strings.Repeat("a", n), n / 8, "aaaaaaaa", "aaaaaaaa"},
		{"words of two letters", loadTest(t), "it" + strings.Repeat(" it", n/3-1), n / 3, "it", " it"},
	}
}

// A prompt of megabytes that is one word (spaces, or a letter the vocab merges) is merged a
// chunk at a time: tokenizing it allocates its tokens and a few MiB, not 40 bytes for each
// of its bytes, and holds nothing of it afterwards. A prompt of many words is
// pre-tokenized a few KiB at a time, not into a list of all its words.
func TestAPromptOfMegabytesTokenizesInMemoryOfItsTokens(t *testing.T) {
	for _, tc := range longTexts(t, 2_000_000) {
		t.Run(tc.name, func(t *testing.T) {
			dst := make([]uint32, 0, tc.tokens+1)
			ids := map[string]uint32{}
			for _, w := range []string{tc.one, tc.next} {
				got, err := tc.tk.Encode(w, false)
				if err != nil || len(got) != 1 {
					t.Fatalf("%q: %v, %v; want one token", w, got, err)
				}
				ids[w] = got[0]
			}
			var err error
			total, kept := allocated(func() { dst, err = tc.tk.AppendEncode(dst, tc.text, false) })
			if err != nil {
				t.Fatal(err)
			}
			if len(dst) != tc.tokens || dst[0] != ids[tc.one] || slices.ContainsFunc(dst[1:], func(id uint32) bool { return id != ids[tc.next] }) {
				t.Fatalf("%d tokens, want %d: %q then %q's", len(dst), tc.tokens, tc.one, tc.next)
			}
			t.Logf("%d bytes: %d KiB allocated besides the tokens, %d KiB kept", len(tc.text), total>>10, kept>>10)
			if total > 4<<20 {
				t.Errorf("tokenizing %d bytes allocated %d MiB besides its tokens, want at most 4", len(tc.text), total>>20)
			}
			if kept > 2<<20 {
				t.Errorf("the tokenizer holds %d MiB more after it, want at most 2", kept>>20)
			}
		})
	}
}

// AppendEncodeMax tokenizes no further than its limit: prompts of 8,000,000 bytes cost what
// 131,072 tokens cost, and give their first 131,072 tokens.
func TestEncodingUpToALimitStopsThere(t *testing.T) {
	const limit = 128 << 10
	for _, tc := range longTexts(t, 8_000_000) {
		t.Run(tc.name, func(t *testing.T) {
			want, err := tc.tk.Encode(tc.text[:min(len(tc.text), 16*limit)], true)
			if err != nil {
				t.Fatal(err)
			}
			var got []uint32
			var whole bool
			total, kept := allocated(func() { got, whole, err = tc.tk.AppendEncodeMax(nil, tc.text, true, limit) })
			if err != nil || whole {
				t.Fatalf("AppendEncodeMax: %v, whole %v; want a text of more than %d tokens", err, whole, limit)
			}
			if !slices.Equal(got, want[:limit]) {
				t.Errorf("%d tokens, not the first %d of the text's", len(got), limit)
			}
			t.Logf("%d bytes: %d KiB allocated, %d KiB kept", len(tc.text), total>>10, kept>>10)
			if total > 8<<20 { // the tokens, 512 KiB, grown as append grows them, and a scratch
				t.Errorf("tokenizing %d tokens of %d bytes allocated %d MiB, want at most 8", limit, len(tc.text), total>>20)
			}
			if kept > 2<<20 {
				t.Errorf("the tokenizer holds %d MiB more after it, want at most 2", kept>>20)
			}
		})
	}
}

// Under the limit, or at it, AppendEncodeMax gives what AppendEncode gives; over it, the
// first limit tokens and false.
func TestEncodingUpToALimitGivesTheTextsTokens(t *testing.T) {
	tokenizers := synthTokenizers(t, 3000)
	tokenizers["testdata"] = loadTest(t)
	var texts []string
	for _, s := range variedTexts(3, 40) {
		if utf8.ValidString(s) { // regexSplit takes text that came through JSON, so UTF-8
			texts = append(texts, s)
		}
	}
	text := strings.Join(texts, "\n")
	for name, tk := range tokenizers {
		t.Run(name, func(t *testing.T) {
			for _, special := range []bool{false, true} {
				want, err := tk.Encode(text, special)
				if err != nil {
					t.Fatal(err)
				}
				n := len(want)
				for _, limit := range []int{0, 1, n / 3, n - 1, n, n + 1, math.MaxInt} {
					got, whole, err := tk.AppendEncodeMax([]uint32{7}, text, special, limit)
					if err != nil {
						t.Fatal(err)
					}
					k := min(limit, n)
					if whole != (limit >= n) || !slices.Equal(got[1:], want[:k]) || got[0] != 7 {
						t.Errorf("special tokens %v, limit %d of %d: whole %v and %d tokens, want %v and the first %d after dst's",
							special, limit, n, whole, len(got)-1, limit >= n, k)
					}
				}
			}
		})
	}
}

// A word longer than a chunk (mergeChunkBytes) is merged a chunk at a time, each chunk's
// end again with the next: its tokens are those of the word merged whole.
func TestALongWordMergesAsItWouldWhole(t *testing.T) {
	tokenizers := synthTokenizers(t, 3000)
	tokenizers["testdata"] = loadTest(t)
	var words []string
	for _, s := range []string{"a", "ab", "aab", "abc", " ", "  x", "the ", "information", "東京", "abcdeESTaa."} {
		words = append(words, strings.Repeat(s, 3*mergeChunkBytes/len(s)+1))
	}
	words = append(words, strings.Join(variedTexts(5, 60), ""))
	for name, tk := range tokenizers {
		t.Run(name, func(t *testing.T) {
			var w mergeScratch
			for _, word := range words {
				if len(word) <= 2*mergeChunkBytes {
					t.Fatalf("a word of %d bytes: too short to merge in chunks", len(word))
				}
				want, _ := tk.model.merge(nil, word, len(word), &w)
				got := tk.model.encode(nil, word, &w, math.MaxInt)
				if !slices.Equal(got, want) {
					at := 0
					for at < min(len(got), len(want)) && got[at] == want[at] {
						at++
					}
					t.Errorf("%.20q... (%d bytes): %d tokens in chunks, %d whole, first differing at token %d", word, len(word), len(got), len(want), at)
				}
			}
		})
	}
}

// A pre-tokenizer that steps (a hand-written pattern, a Split's regex a window at a time)
// finds the pieces split finds in the whole text.
func TestSteppingFindsThePiecesOfTheWholeText(t *testing.T) {
	tokenizers := synthTokenizers(t, 10)
	tokenizers["testdata"] = loadTest(t)
	tokenizers["gpt2 without a prefix space"] = mustLoad(t, bpeFile(t, nil, map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}, false))
	tokenizers["regexp2, then Llama 3's"] = mustLoad(t, bpeFile(t, nil, map[string]any{"type": "Sequence", "pretokenizers": []any{
		map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `\p{N}{1,3}`}, "behavior": "Isolated"},
		map[string]any{"type": "Split", "pattern": map[string]any{"Regex": llama3Pattern}, "behavior": "Isolated"},
		map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}}}, false))
	tokenizers["regexp2, removed"] = mustLoad(t, bpeFile(t, nil, map[string]any{"type": "Sequence", "pretokenizers": []any{
		map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `\s+`}, "behavior": "Removed"},
		map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}}}, false))
	var texts []string
	for seed := range uint64(3) {
		var b strings.Builder
		for _, s := range variedTexts(10+seed, 1000) {
			if len(s) < 2*windowBytes/3 && utf8.ValidString(s) { // a piece longer than the window is cut
				b.WriteString(s)
			}
			if b.Len() > 4*windowBytes {
				break
			}
		}
		texts = append(texts, b.String())
	}
	texts = append(texts, strings.Repeat("東京タワー、", 4*stepBytes))
	for name, tk := range tokenizers {
		st, ok := tk.pre.(stepper)
		if !ok {
			continue
		}
		t.Run(name, func(t *testing.T) {
			for i, text := range texts {
				want, err := tk.pre.split(nil, text)
				if err != nil {
					t.Fatal(err)
				}
				var got []string
				for s := text; s != ""; {
					var n int
					if got, n, err = st.step(got, s); err != nil {
						t.Fatal(err)
					}
					s = s[n:]
				}
				if !slices.Equal(got, want) {
					at := 0
					for at < min(len(got), len(want)) && got[at] == want[at] {
						at++
					}
					t.Errorf("text %d (%d bytes): %d pieces stepping, %d whole, first differing at piece %d", i, len(text), len(got), len(want), at)
				}
			}
		})
	}
}

func mustLoad(t testing.TB, data []byte) *Tokenizer {
	t.Helper()
	tk, err := Load(data)
	if err != nil {
		t.Fatal(err)
	}
	return tk
}
