package hftok

import (
	"strings"
	"testing"
)

// benchText is a chat turn's worth of English, about 4 KiB.
var benchText = strings.Repeat("You are a helpful assistant. The proxy sends a request to the engine that already holds its prompt's longest prefix, 1234 times. ", 32)

func BenchmarkEncode(b *testing.B) {
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
