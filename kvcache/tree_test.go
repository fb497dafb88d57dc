package kvcache

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
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

func TestTreeKeepsATextRoutedAgainWhileOlderOnesGo(t *testing.T) {
	tr := NewTree(16 << 10)
	keep := "a session that keeps coming back: " + strings.Repeat("k", 200)
	for i := range 2000 {
		if i%10 == 0 {
			tr.Insert(keep, "a")
		}
		tr.Insert(fmt.Sprintf("one-off %04d %s", i, strings.Repeat("o", 100)), "b")
	}
	got := make([]int, 1)
	tr.Match(keep, []string{"a"}, got)
	if got[0] != len(keep) {
		t.Errorf("the text routed again matched %d of %d bytes: it was evicted before older ones", got[0], len(keep))
	}
	tr.Match("one-off 0000 o", []string{"b"}, got)
	if got[0] == len("one-off 0000 o") {
		t.Error("the oldest one-off text is still there")
	}
	if s := tr.Stats(); s.Bytes > s.MaxBytes {
		t.Errorf("tree holds %d bytes, over its bound %d", s.Bytes, s.MaxBytes)
	}
}

// check recounts what the tree keeps count of, and its list of leaves.
func (t *Tree) check() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	bytes, nodes, leaves := 0, 0, map[*node]bool{}
	text := map[string]int{}
	var walk func(n *node) error
	walk = func(n *node) error {
		for _, c := range n.children {
			if c.parent != n {
				return fmt.Errorf("node %q has the wrong parent", c.edge)
			}
			for _, m := range c.marks {
				if n != &t.root {
					pm := n.markOf(m.engine)
					if pm == nil {
						return fmt.Errorf("engine %s on %q but not on its parent %q", m.engine, c.edge, n.edge)
					}
					if pm.at < m.at {
						return fmt.Errorf("engine %s on %q is newer than on its parent %q", m.engine, c.edge, n.edge)
					}
				}
				text[m.engine] += len(c.edge)
			}
			bytes += c.cost()
			nodes++
			if len(c.children) == 0 {
				leaves[c] = true
			}
			if err := walk(c); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(&t.root); err != nil {
		return err
	}
	listed := 0
	for n := t.leaves.next; n != &t.leaves; n = n.next {
		if !leaves[n] {
			return fmt.Errorf("%q is listed as a leaf and is not one", n.edge)
		}
		listed++
	}
	switch {
	case bytes != t.bytes || nodes != t.nodes:
		return fmt.Errorf("counted %d bytes, %d nodes; recounted %d, %d", t.bytes, t.nodes, bytes, nodes)
	case listed != len(leaves):
		return fmt.Errorf("%d leaves listed of %d", listed, len(leaves))
	case !maps.Equal(text, t.text):
		return fmt.Errorf("text per engine counted %v, recounted %v", t.text, text)
	}
	return nil
}

func TestTreeKeepsItsCountsRightThroughAnyMixOfOperations(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	words := []string{"system ", "user ", "hello ", "world ", "again ", "x", "yy", "zzz"}
	tr := NewTree(2 << 10)
	for i := range 5000 {
		var b strings.Builder
		for range rng.IntN(12) {
			b.WriteString(words[rng.IntN(len(words))])
		}
		engine := fmt.Sprint("e", rng.IntN(4))
		switch rng.IntN(20) {
		case 0:
			tr.Forget(engine)
		case 1:
			tr.Retain(func(e string) bool { return e != engine })
		default:
			tr.Insert(b.String(), engine)
		}
		if err := tr.check(); err != nil {
			t.Fatalf("after operation %d: %v", i, err)
		}
	}
}

func TestTreeMatchNamesInALargePoolAsOneByOne(t *testing.T) {
	// Past smallPool engines a mark finds its engine by a map: the same answers as a pass
	// over a few engines at a time.
	tr := NewTree(0)
	var engines []string
	for i := range 40 {
		e := fmt.Sprintf("e%d", i)
		engines = append(engines, e)
		tr.InsertAt("system prompt "+strings.Repeat("x", i)+" user", e, time.Unix(int64(i), 0))
	}
	text := "system prompt " + strings.Repeat("x", 25) + " user asks"
	since := make([]time.Time, len(engines))
	since[30] = time.Unix(31, 0) // e30's text is older than asked: none of it counts
	got := make([]int, len(engines))
	tr.MatchNames(text, NewNames(engines), since, got)
	for i, e := range engines {
		one := make([]int, 1)
		tr.MatchSince(text, []string{e}, since[i:i+1], one)
		if got[i] != one[0] {
			t.Errorf("%s: matched %d among 40, %d alone", e, got[i], one[0])
		}
	}
	if got[25] != len("system prompt ")+25+len(" user") {
		t.Errorf("the engine sent this very prompt's head matched %d bytes", got[25])
	}
}

func TestTreeMatchSaysWhenTheTextItContinuesWasRouted(t *testing.T) {
	// A conversation's next turn continues its last one, whichever engine that went to and
	// whether or not it still counts there: the match says when it was routed. A prompt that
	// shares only a head with others is told when that head was last routed.
	tr := NewTree(0)
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	const preamble = "you are an agent with these tools: read, write, run. "
	tr.InsertAt(preamble+"task A", "e0", at(10))
	tr.InsertAt(preamble+"task A, result 1", "e1", at(20))
	tr.InsertAt(preamble+"task B", "e0", at(30))
	engines := []string{"e0", "e1"}
	for _, tc := range []struct {
		text  string
		since []time.Time
		want  time.Time
	}{
		{preamble + "task A, result 1, result 2", nil, at(20)},
		{preamble + "task A, result 1, result 2", []time.Time{at(25), at(25)}, at(20)}, // counted nowhere, known all the same
		{preamble + "task A, other", nil, at(20)},                                      // the node of "task A" was last routed at 20
		{preamble + "task C", nil, at(30)},
		{"something else entirely", nil, time.Time{}},
	} {
		matched := make([]int, len(engines))
		if got := tr.MatchSince(tc.text, engines, tc.since, matched); !got.Equal(tc.want) {
			t.Errorf("MatchSince(%q) says it was routed at %v, want %v", tc.text, got, tc.want)
		}
		if got := tr.MatchNames(tc.text, NewNames(engines), tc.since, matched); !got.Equal(tc.want) {
			t.Errorf("MatchNames(%q) says it was routed at %v, want %v", tc.text, got, tc.want)
		}
		if got := tr.MatchDeep(tc.text, 1, func(string, int, int64) {}); !got.Equal(tc.want) {
			t.Errorf("MatchDeep(%q) says it was routed at %v, want %v", tc.text, got, tc.want)
		}
	}
}
