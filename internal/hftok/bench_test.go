package hftok

import (
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
)

// benchText is a chat turn's worth of English, about 4 KiB.
var benchText = strings.Repeat("You are a helpful assistant. The proxy sends a request to the engine that already holds its prompt's longest prefix, 1234 times. ", 32)

// BenchmarkEncode encodes a prompt of words seen before that is new as a whole, as a
// chat's newest message is: its words come from the cache, its segment does not.
func BenchmarkEncode(b *testing.B) {
	tk := loadTest(b)
	b.SetBytes(int64(len(benchText)))
	for i := 0; b.Loop(); i++ {
		if _, err := tk.Encode(strconv.Itoa(i)+benchText, true); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEncodeSeen encodes the same prompt again, as a system prompt or an earlier
// message comes back: one lookup of its segment.
func BenchmarkEncodeSeen(b *testing.B) {
	tk := loadTest(b)
	b.SetBytes(int64(len(benchText)))
	for b.Loop() {
		if _, err := tk.Encode(benchText, true); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkRender(b *testing.B) {
	tpl, err := LoadTemplate(testConfig)
	if err != nil {
		b.Fatal(err)
	}
	msgs := []Message{{"system", benchText}, {"user", "What is the capital of France?"}, {"assistant", "Paris."}, {"user", "And of Italy?"}}
	for b.Loop() {
		if _, err := tpl.Render(msgs, true); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEncodeNewWords encodes 4 KiB prompts, each new as a whole, of words seen rarely
// enough that most are not cached: the merging itself.
func BenchmarkEncodeNewWords(b *testing.B) {
	tk := loadTest(b)
	rng := rand.New(rand.NewPCG(1, 2))
	texts := make([]string, 512)
	for i := range texts {
		var s strings.Builder
		for s.Len() < len(benchText) {
			s.WriteByte(' ')
			for range 3 + rng.IntN(7) {
				s.WriteByte(byte('a' + rng.IntN(26)))
			}
		}
		texts[i] = s.String()
	}
	b.SetBytes(int64(len(benchText)))
	i := 0
	for b.Loop() {
		if _, err := tk.Encode(strconv.Itoa(i)+texts[i%len(texts)], false); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// BenchmarkEncodeLongWord encodes one word of 16 KiB (a pasted blob of letters), new each
// time, which no cache holds.
func BenchmarkEncodeLongWord(b *testing.B) {
	tk := loadTest(b)
	word := strings.Repeat("thequickbrownfoxjumpsoverthelazydog", 16<<10/35)
	b.SetBytes(int64(len(word)))
	for i := 0; b.Loop(); i++ {
		var head []byte
		for n := i; n > 0; n /= 26 {
			head = append(head, byte('a'+n%26))
		}
		if _, err := tk.Encode(string(head)+word, false); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEncodeLongRun encodes a run of 1 MiB of spaces, one word that is merged a chunk
// at a time.
func BenchmarkEncodeLongRun(b *testing.B) {
	tk := loadTest(b)
	run := strings.Repeat(" ", 1<<20)
	dst := make([]uint32, 0, len(run))
	b.SetBytes(int64(len(run)))
	for b.Loop() {
		if _, err := tk.AppendEncode(dst, run, false); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEncodeUpToALimit encodes the first 131,072 tokens of a prompt of 8,000,000
// spaces, as the router asks for a prompt longer than it matches.
func BenchmarkEncodeUpToALimit(b *testing.B) {
	tk := loadTest(b)
	text := strings.Repeat(" ", 8_000_000)
	dst := make([]uint32, 0, 1<<18)
	for b.Loop() {
		if _, whole, err := tk.AppendEncodeMax(dst, text, true, 128<<10); err != nil || whole {
			b.Fatal(whole, err)
		}
	}
}
