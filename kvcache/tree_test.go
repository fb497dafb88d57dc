package kvcache

import (
	"fmt"
	"strings"
	"testing"
)

func TestTreeMatch(t *testing.T) {
	system := "You are a helpful assistant. "
	tests := []struct {
		name    string
		inserts [][2]string // text, engine
		text    string
		want    map[string]int
	}{
		{name: "an empty tree matches nothing", text: "hello", want: map[string]int{"a": 0, "b": 0}},
		{name: "a session's next turn matches all of its previous turn on its engine",
			inserts: [][2]string{{system + "user: hi", "a"}, {system + "user: bye", "b"}},
			text:    system + "user: hi assistant: hello user: more",
			want:    map[string]int{"a": len(system + "user: hi"), "b": len(system + "user: ")}},
		{name: "an engine sent a longer text matches the request's whole text",
			inserts: [][2]string{{"abcdef", "a"}},
			text:    "abc", want: map[string]int{"a": 3, "b": 0}},
		{name: "a split edge keeps both engines' marks",
			inserts: [][2]string{{"abcdef", "a"}, {"abcxyz", "b"}},
			text:    "abcdefg", want: map[string]int{"a": 6, "b": 3}},
		{name: "a text diverging at the first byte matches nothing",
			inserts: [][2]string{{"abc", "a"}},
			text:    "xbc", want: map[string]int{"a": 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := NewTree(1 << 20)
			for _, in := range tt.inserts {
				tr.Insert(in[0], in[1])
			}
			var engines []string
			for e := range tt.want {
				engines = append(engines, e)
			}
			got := make([]int, len(engines))
			tr.Match(tt.text, engines, got)
			for i, e := range engines {
				if got[i] != tt.want[e] {
					t.Errorf("engine %s matched %d bytes, want %d", e, got[i], tt.want[e])
				}
			}
		})
	}
}

func TestTreeStaysWithinItsBoundEvictingTheLeastRecentlyRouted(t *testing.T) {
	const bound = 64 << 10
	tr := NewTree(bound)
	hot := strings.Repeat("hot system prompt ", 20)
	for i := range 5000 {
		tr.Insert(hot+fmt.Sprintf("user %d: %s", i, strings.Repeat("x", 100)), "a")
		if s := tr.Stats(); s.Bytes > bound {
			t.Fatalf("after %d inserts the tree holds %d bytes, over its bound %d", i+1, s.Bytes, bound)
		}
	}
	got := make([]int, 1)
	tr.Match(hot+"user 4999: ", []string{"a"}, got)
	if got[0] < len(hot) {
		t.Errorf("the latest text matched %d bytes, want at least the hot prefix %d: the newest must survive", got[0], len(hot))
	}
	tr.Match(hot+"user 0: x", []string{"a"}, got)
	if want := len(hot + "user "); got[0] > want {
		t.Errorf("the first text still matches %d bytes, want at most %d: the oldest leaf must be evicted", got[0], want)
	}
}

func TestTreeOneHugeTextDoesNotFlushTheRest(t *testing.T) {
	tr := NewTree(10 << 10)
	tr.Insert("keep me", "a")
	tr.Insert(strings.Repeat("y", 1<<20), "b")
	got := make([]int, 1)
	tr.Match("keep me", []string{"a"}, got)
	if got[0] != len("keep me") {
		t.Errorf("matched %d bytes of the earlier text after a huge one, want %d", got[0], len("keep me"))
	}
	if s := tr.Stats(); s.Bytes > s.MaxBytes {
		t.Errorf("tree holds %d bytes, over its bound %d", s.Bytes, s.MaxBytes)
	}
}

func TestTreeForgetAndRetain(t *testing.T) {
	tr := NewTree(1 << 20)
	tr.Insert("shared prefix then a", "a")
	tr.Insert("shared prefix then b", "b")
	tr.Insert("only c", "c")
	tr.Forget("a")
	tr.Retain(func(e string) bool { return e != "c" })
	got := make([]int, 3)
	tr.Match("shared prefix then a", []string{"a", "b", "c"}, got)
	if got[0] != 0 || got[2] != 0 {
		t.Errorf("forgotten engines still match: a %d, c %d", got[0], got[2])
	}
	if got[1] != len("shared prefix then ") {
		t.Errorf("the kept engine matches %d, want %d", got[1], len("shared prefix then "))
	}
	if n := tr.EngineBytes("c"); n != 0 {
		t.Errorf("a retained-out engine still holds %d bytes", n)
	}
	tr.Forget("b")
	if s := tr.Stats(); s.Nodes != 0 || s.Bytes != 0 {
		t.Errorf("a tree with every engine forgotten holds %+v, want nothing", s)
	}
}

func TestTreeEngineBytesFollowsInsertsSplitsAndEvictions(t *testing.T) {
	tr := NewTree(4 << 10)
	tr.Insert("abcdef", "a")
	tr.Insert("abcxyz", "b")
	tr.Insert("abcdefgh", "a")
	if got := tr.EngineBytes("a"); got != len("abcdefgh") {
		t.Errorf("a holds %d bytes, want %d", got, len("abcdefgh"))
	}
	if got := tr.EngineBytes("b"); got != len("abcxyz") {
		t.Errorf("b holds %d bytes, want %d", got, len("abcxyz"))
	}
	for i := range 200 {
		tr.Insert(fmt.Sprintf("%03d %s", i, strings.Repeat("z", 50)), "c")
	}
	if got := tr.EngineBytes("a"); got != 0 {
		t.Errorf("after a flood of newer texts a still holds %d bytes, want its texts evicted", got)
	}
	if got, s := tr.EngineBytes("c"), tr.Stats(); got <= 0 || got > s.Bytes {
		t.Errorf("c holds %d bytes of a tree of %d", got, s.Bytes)
	}
}
