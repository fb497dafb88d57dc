package hftok

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"
)

// bpeFile writes a tokenizer.json whose vocab is the 256 byte characters and what merges
// make of them, with ChatML's two special tokens; pre is its pre_tokenizer.
func bpeFile(t testing.TB, merges [][2]string, pre any, ignoreMerges bool) []byte {
	t.Helper()
	vocab := map[string]int{}
	for b, c := range byteChars {
		vocab[c] = b
	}
	for _, m := range merges {
		if _, ok := vocab[m[0]+m[1]]; !ok {
			vocab[m[0]+m[1]] = len(vocab)
		}
	}
	f := map[string]any{
		"added_tokens": []any{
			map[string]any{"id": len(vocab), "content": "<|im_start|>", "special": true},
			map[string]any{"id": len(vocab) + 1, "content": "<|im_end|>", "special": true},
		},
		"pre_tokenizer": pre,
		"model":         map[string]any{"type": "BPE", "vocab": vocab, "merges": merges, "ignore_merges": ignoreMerges},
	}
	out, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// randomMerges are n merges that build, bottom up in a random order, the pieces of texts
// like variedTexts' (so that they apply to those), most of them in the order a trainer
// learns them (both parts exist before the merge) and a twentieth moved to ranks a trainer
// never gives, so that a merge can make a pair that ranks before the one just merged.
func randomMerges(seed uint64, n int) [][2]string {
	rng := rand.New(rand.NewPCG(seed, 7))
	var words []string
	for _, s := range variedTexts(seed+100, 300) {
		words, _ = llama3Split{maxDigits: 3}.split(words, s)
	}
	var merges [][2]string
	seen := map[[2]string]bool{}
	for len(merges) < n {
		w := words[rng.IntN(len(words))]
		var syms []string
		for i := 0; i < len(w); i++ {
			syms = append(syms, byteChars[w[i]])
		}
		for len(syms) > 1 && rng.IntN(16) != 0 && len(merges) < n {
			i := rng.IntN(len(syms) - 1)
			m := [2]string{syms[i], syms[i+1]}
			if !seen[m] {
				seen[m] = true
				merges = append(merges, m)
			}
			syms = slices.Replace(syms, i, i+2, m[0]+m[1])
		}
	}
	for range n / 20 {
		i, j := rng.IntN(n), rng.IntN(n)
		merges[i], merges[j] = merges[j], merges[i]
	}
	return merges
}

// synthTokenizers are the pre-tokenizers a synthetic file is tried with: Llama 3's pattern
// (matched by hand), GPT-2's (ByteLevel with its regex and a prefix space), a pattern only
// regexp2 matches, and none (the whole text one word).
func synthTokenizers(t testing.TB, merges int) map[string]*Tokenizer {
	t.Helper()
	byteLevel := func(prefix, regex bool) map[string]any {
		return map[string]any{"type": "ByteLevel", "add_prefix_space": prefix, "use_regex": regex}
	}
	split := func(expr string) map[string]any {
		return map[string]any{"type": "Split", "pattern": map[string]any{"Regex": expr}, "behavior": "Isolated"}
	}
	pres := map[string]any{
		"llama3":       map[string]any{"type": "Sequence", "pretokenizers": []any{split(llama3Pattern), byteLevel(false, false)}},
		"gpt2":         byteLevel(true, true),
		"regexp2":      map[string]any{"type": "Sequence", "pretokenizers": []any{split(`\s?\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+`), byteLevel(false, false)}},
		"one_word":     byteLevel(false, false),
		"llama3_plain": map[string]any{"type": "Sequence", "pretokenizers": []any{split(llama3Pattern), byteLevel(false, false)}},
	}
	out := map[string]*Tokenizer{}
	for name, pre := range pres {
		tk, err := Load(bpeFile(t, randomMerges(1, merges), pre, name != "llama3_plain"))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = tk
	}
	return out
}

// variedTexts are n texts of the kinds a cache or a merge order gets wrong: words that
// repeat, one letter repeated hundreds of times, runs of spaces, tabs and line breaks,
// accented and non-Latin letters, emoji, digits, contractions, code, special tokens, and
// bytes that are not UTF-8.
func variedTexts(seed uint64, n int) []string {
	rng := rand.New(rand.NewPCG(seed, 11))
	words := []string{"the", " the", "cab", "abab", "information", "Straße", "naïve", "東京", "🙂👍🏽", "1234567", "don't", "WE'LL", "x", "é",
		"\t", "  ", "\n\n", "\r\n", "<|im_start|>", "<|im_end|>", "def main():", "{'a': [1, 2]}", "ÀÉÎ", "\u00a0", "\u3000", "\xff\xfe", "e\u0301"}
	letters := "abcdeESTaa."
	var out []string
	for range n {
		var b strings.Builder
		for range 1 + rng.IntN(40) {
			switch k := rng.IntN(10); {
			case k < 5:
				b.WriteString(words[rng.IntN(len(words))])
			case k < 8:
				for range 1 + rng.IntN(12) {
					b.WriteByte(letters[rng.IntN(len(letters))])
				}
			case k < 9:
				b.WriteString(strings.Repeat(words[rng.IntN(5)], 1+rng.IntN(80)))
			default:
				b.WriteString(strings.Repeat(string(" \t\n"[rng.IntN(3)]), 1+rng.IntN(300)))
			}
			if rng.IntN(2) == 0 {
				b.WriteByte(' ')
			}
		}
		out = append(out, b.String())
	}
	for _, s := range []string{"a", "aa", "aaa", "aaaa", "ababab", "abababa"} {
		out = append(out, s, strings.Repeat(s, 257), " "+strings.Repeat(s, 33))
	}
	return out
}

// plainMerge is the merging bpe.encode must match, done the plain way: each round scans the
// word for its pair of lowest rank, then merges every occurrence of it left to right.
func plainMerge(m *bpe, word string) []uint32 {
	if m.ignoreMerges {
		var mapped []byte
		for i := 0; i < len(word); i++ {
			mapped = append(mapped, byteChars[word[i]]...)
		}
		if id, ok := m.vocab[string(mapped)]; ok {
			return []uint32{id}
		}
	}
	ids := make([]uint32, len(word))
	for i := 0; i < len(word); i++ {
		ids[i] = m.byteIDs[word[i]]
	}
	for {
		best, at := merge{}, -1
		for i := 0; i+1 < len(ids); i++ {
			if mg, ok := m.merges[pairKey(ids[i], ids[i+1])]; ok && (at < 0 || mg.rank < best.rank) {
				best, at = mg, i
			}
		}
		if at < 0 {
			return ids
		}
		a, b := ids[at], ids[at+1]
		var out []uint32
		for i := 0; i < len(ids); i++ {
			if i >= at && i+1 < len(ids) && ids[i] == a && ids[i+1] == b {
				out = append(out, best.id)
				i++
				continue
			}
			out = append(out, ids[i])
		}
		ids = out
	}
}

// plainEncode is Encode without its cache, its scratch or its merge heap.
func plainEncode(t testing.TB, tk *Tokenizer, text string) []uint32 {
	t.Helper()
	var out []uint32
	start := 0
	words := func(end int) {
		if end <= start {
			return
		}
		seg := text[start:end]
		if tk.normalize != nil {
			seg = tk.normalize(seg)
		}
		pieces, err := tk.pre.split(nil, seg)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pieces {
			out = append(out, plainMerge(tk.model, p)...)
		}
	}
	for i := 0; i < len(text); {
		if a, ok := matchAdded(tk.added[text[i]], text[i:]); ok {
			words(i)
			out = append(out, a.id)
			i += len(a.content)
			start = i
			continue
		}
		i++
	}
	words(len(text))
	return out
}

func TestEncodeGivesThePlainMergesTokens(t *testing.T) {
	tokenizers := synthTokenizers(t, 3000)
	tokenizers["testdata"] = loadTest(t)
	texts := variedTexts(1, 400)
	for name, tk := range tokenizers {
		t.Run(name, func(t *testing.T) {
			texts := texts
			if name == "regexp2" {
				// regexp2 gives up a match after 100 ms of wall time: the race detector
				// on a busy machine must not make that a failure here.
				texts = texts[:60]
			}
			var bytes, tokens int
			for pass, what := range []string{"nothing cached yet", "words and segments cached"} {
				for i, s := range texts {
					if name == "regexp2" && !utf8.ValidString(s) {
						continue // regexSplit takes text that came through JSON, so UTF-8
					}
					got, err := tk.Encode(s, false)
					if err != nil {
						t.Fatal(err)
					}
					if want := plainEncode(t, tk, s); !slices.Equal(got, want) {
						t.Fatalf("%s, text %d %.80q: tokens %v, the plain merge's %v", what, i, s, got, want)
					}
					if pass == 0 {
						bytes, tokens = bytes+len(s), tokens+len(got)
					}
				}
			}
			if name != "testdata" && tokens > bytes/2 {
				t.Errorf("%d tokens for %d bytes: too few merges to test the merging", tokens, bytes)
			}
		})
	}
}

func TestMergeRounds(t *testing.T) {
	dec := func(tk *Tokenizer, ids []uint32) []string {
		names := map[uint32]string{}
		for tok, id := range tk.model.vocab {
			names[id] = tok
		}
		var out []string
		for _, id := range ids {
			out = append(out, names[id])
		}
		return out
	}
	for _, tc := range []struct {
		name         string
		merges       [][2]string
		ignoreMerges bool
		word         string
		want         []string
	}{
		{"a pair that overlaps one just merged is gone", [][2]string{{"a", "a"}}, false, "aaa", []string{"aa", "a"}},
		{"every occurrence of the round's pair merges", [][2]string{{"a", "a"}, {"aa", "aa"}}, false, "aaaaaaaaa", []string{"aaaa", "aaaa", "a"}},
		{"the pair of lowest rank merges first", [][2]string{{"b", "c"}, {"a", "b"}}, false, "abc", []string{"a", "bc"}},
		{"a pair that a round makes waits for the next round, whatever its rank", [][2]string{{"ab", "a"}, {"a", "b"}}, false, "abab", []string{"ab", "ab"}},
		{"then it merges before pairs of higher rank", [][2]string{{"ab", "c"}, {"a", "b"}, {"c", "d"}}, false, "abcd", []string{"abc", "d"}},
		{"a word in the vocab is its token with ignore_merges", [][2]string{{"b", "c"}, {"a", "b"}, {"a", "bc"}}, true, "abc", []string{"abc"}},
		{"and merges as any word without", [][2]string{{"b", "c"}, {"a", "b"}, {"a", "bc"}}, false, "abc", []string{"abc"}},
		{"a word of bytes no merge takes stays bytes", [][2]string{{"a", "b"}}, false, "xyz", []string{"x", "y", "z"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tk, err := Load(bpeFile(t, tc.merges, map[string]any{"type": "ByteLevel", "use_regex": false}, tc.ignoreMerges))
			if err != nil {
				t.Fatal(err)
			}
			for _, what := range []string{"merged", "cached"} {
				ids, err := tk.Encode(tc.word, false)
				if err != nil {
					t.Fatal(err)
				}
				if got := dec(tk, ids); !slices.Equal(got, tc.want) {
					t.Errorf("%s: %q as %q, want %q", what, tc.word, got, tc.want)
				}
			}
		})
	}
}

// Encodings at once share the cache: whichever stores a word, every one gets its tokens.
func TestConcurrentEncodingsShareTheCache(t *testing.T) {
	tk := synthTokenizers(t, 3000)["llama3"]
	texts := variedTexts(2, 80)
	want := make([][]uint32, len(texts))
	for i, s := range texts {
		want[i] = plainEncode(t, tk, s)
	}
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Go(func() {
			for k := range 2 * len(texts) {
				i := (g*7 + k) % len(texts)
				if got, err := tk.Encode(texts[i], false); err != nil || !slices.Equal(got, want[i]) {
					t.Errorf("goroutine %d, text %d: %v, %v", g, i, got, err)
					return
				}
			}
		})
	}
	wg.Wait()
}

// Text made of ever new words, some of them long, churns the cache: it keeps its size, and
// a word pushed out is merged again, to the same tokens.
func TestTheCacheKeepsItsSizeOnEverNewWords(t *testing.T) {
	tk := synthTokenizers(t, 3000)["llama3"]
	rng := rand.New(rand.NewPCG(5, 5))
	var b strings.Builder
	for range wordCacheSlots + wordCacheSlots/4 {
		b.WriteByte(' ')
		for range 2 + rng.IntN(3*maxCachedWordBytes/2) {
			b.WriteByte("abcdefghij"[rng.IntN(10)])
		}
	}
	text := b.String()
	want := plainEncode(t, tk, text)
	for pass := range 2 {
		got, err := tk.Encode(text, false)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("pass %d: the tokens differ from the plain merge's", pass)
		}
	}
	for i := range tk.model.cache.slots {
		if e := tk.model.cache.slots[i].Load(); e != nil && len(e.text) > maxCachedWordBytes {
			t.Fatalf("a word of %d bytes is cached", len(e.text))
		}
	}
	if n := len(tk.model.cache.slots); n != wordCacheSlots {
		t.Errorf("%d slots", n)
	}
}

// Long segments, each new, fill the segments' cache to its budget and no further: the
// oldest are pushed out, and what it holds is what it counts.
func TestTheSegmentCacheKeepsToItsBudget(t *testing.T) {
	tk := loadTest(t)
	const budget = 1 << 20
	tk.segments = newTokenCache(64, budget)
	rng := rand.New(rand.NewPCG(6, 6))
	var texts []string
	for range 2 * budget / (5 * 16 << 10) {
		var b strings.Builder
		for b.Len() < 16<<10 {
			fmt.Fprintf(&b, " %x", rng.Uint64())
		}
		texts = append(texts, "<|im_start|>user\n"+b.String()+"<|im_end|>")
	}
	want := make([][]uint32, len(texts))
	for i, s := range texts {
		want[i] = plainEncode(t, tk, s)
	}
	for pass := range 2 {
		for i, s := range texts {
			got, err := tk.Encode(s, false)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want[i]) {
				t.Fatalf("pass %d, text %d: the tokens differ from the plain merge's", pass, i)
			}
		}
	}
	var held int64
	entries := 0
	for i := range tk.segments.slots {
		if e := tk.segments.slots[i].Load(); e != nil {
			held += e.size()
			entries++
		}
	}
	if held != tk.segments.held.Load() || held > budget || entries == 0 {
		t.Errorf("the cache holds %d bytes in %d entries, counts %d, may hold %d", held, entries, tk.segments.held.Load(), budget)
	}
}
