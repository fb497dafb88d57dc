package router

import (
	"fmt"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestLeastInflight(t *testing.T) {
	tests := []struct {
		name     string
		inflight []int64
		weights  []int
		want     []string // acceptable picks over several calls, in order
	}{
		{"picks the fewest in flight", []int64{5, 1, 3}, nil, []string{"b1", "b1", "b1"}},
		{"a tie goes to the higher weight", []int64{2, 2, 2}, []int{1, 3, 1}, []string{"b1", "b1"}},
		{"an equal tie rotates so load spreads", []int64{0, 0, 0}, nil, []string{"b0", "b1", "b2", "b0"}},
		{"a single candidate is picked", []int64{9}, nil, []string{"b0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bs := testBackends(tt.inflight...)
			for i, w := range tt.weights {
				bs[i].Weight = w
			}
			p := &LeastInflight{}
			var got []string
			for range tt.want {
				got = append(got, p.Select(bs, Hint{}).Name)
			}
			if strings.Join(got, ",") != strings.Join(tt.want, ",") {
				t.Errorf("picks = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestLeastInflightSpreadsWhenCountsMove(t *testing.T) {
	bs := testBackends(0, 0, 0, 0)
	p := &LeastInflight{}
	for range 40 {
		b := p.Select(bs, Hint{})
		b.st.inflight.Add(1)
	}
	for _, b := range bs {
		if b.Inflight() != 10 {
			t.Errorf("%s got %d of 40, want 10", b.Name, b.Inflight())
		}
	}
}

func TestRoundRobinFollowsWeights(t *testing.T) {
	tests := []struct {
		name    string
		weights []int
		picks   int
		want    map[string]int
	}{
		{"equal weights take turns", []int{1, 1, 1}, 30, map[string]int{"b0": 10, "b1": 10, "b2": 10}},
		{"weights split in proportion", []int{3, 1}, 40, map[string]int{"b0": 30, "b1": 10}},
		{"zero weight counts as one", []int{0, 1}, 10, map[string]int{"b0": 5, "b1": 5}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bs := testBackends(make([]int64, len(tt.weights))...)
			for i, w := range tt.weights {
				bs[i].Weight = w
			}
			p := &RoundRobin{}
			got := map[string]int{}
			for range tt.picks {
				got[p.Select(bs, Hint{}).Name]++
			}
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("picks = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestRoundRobinInterleavesHeavyBackend(t *testing.T) {
	bs := testBackends(0, 0)
	bs[0].Weight = 2
	p := &RoundRobin{}
	var got []string
	for range 6 {
		got = append(got, p.Select(bs, Hint{}).Name)
	}
	// Smooth WRR: b0 b1 b0 repeating, never b0 b0 b0 b1.
	if want := "b0,b1,b0,b0,b1,b0"; strings.Join(got, ",") != want {
		t.Errorf("sequence = %v, want %s", got, want)
	}
}

func TestPowerOfTwoKeepsTheLessLoadedOfTwoSamples(t *testing.T) {
	tests := []struct {
		name     string
		inflight []int64
		draws    []int // what the injected rand returns, in order
		want     string
	}{
		{"second sample less loaded", []int64{4, 1, 9}, []int{0, 0}, "b1"}, // i=0, j=0->1
		{"first sample less loaded", []int64{4, 1, 9}, []int{1, 1}, "b1"},  // i=1, j=1->2
		{"never the two-way loser", []int64{4, 1, 9}, []int{2, 0}, "b0"},   // i=2, j=0
		{"one candidate needs no draw", []int64{7}, nil, "b0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			draws := tt.draws
			p := &PowerOfTwo{rand: func(n int) int {
				d := draws[0]
				draws = draws[1:]
				if d >= n {
					t.Fatalf("draw %d out of [0,%d)", d, n)
				}
				return d
			}}
			if got := p.Select(testBackends(tt.inflight...), Hint{}).Name; got != tt.want {
				t.Errorf("pick = %s, want %s", got, tt.want)
			}
		})
	}
}

func TestPowerOfTwoNeverPicksTheMostLoaded(t *testing.T) {
	bs := testBackends(1, 2, 3, 100)
	p := &PowerOfTwo{}
	for range 1000 {
		if b := p.Select(bs, Hint{}); b.Name == "b3" {
			t.Fatal("picked the most loaded backend")
		}
	}
}

func prompt(i int) string { return fmt.Sprintf("system: you are assistant number %d. user: ", i) }

func TestPrefixAffinitySamePrefixSameBackend(t *testing.T) {
	bs := testBackends(0, 0, 0, 0)
	p := NewPrefixAffinity(16) // 64 bytes
	for i := range 50 {
		head := prompt(i) + strings.Repeat("x", 64)
		first := p.Select(bs, Hint{Prefix: head + "tail one"})
		second := p.Select(bs, Hint{Prefix: head + "a different tail past the hashed bytes"})
		if first != second {
			t.Fatalf("prompt %d: %s then %s; text past prefix_tokens*4 bytes must not matter", i, first.Name, second.Name)
		}
	}
}

func TestPrefixAffinitySpreadsPrefixes(t *testing.T) {
	bs := testBackends(0, 0, 0, 0)
	p := NewPrefixAffinity(256)
	got := map[string]int{}
	for i := range 4000 {
		got[p.Select(bs, Hint{Prefix: prompt(i)}).Name]++
	}
	for _, b := range bs {
		// Virtual nodes keep each share near 1000; 600 leaves room for hash luck.
		if got[b.Name] < 600 {
			t.Errorf("%s got %d of 4000 prefixes: %v", b.Name, got[b.Name], got)
		}
	}
}

func TestPrefixAffinityLosingABackendMovesOnlyItsKeys(t *testing.T) {
	bs := testBackends(0, 0, 0, 0)
	p := NewPrefixAffinity(256)
	p.SetPool(bs)
	before := map[int]string{}
	for i := range 1000 {
		before[i] = p.Select(bs, Hint{Prefix: prompt(i)}).Name
	}
	// b2 becomes ineligible (unhealthy or full): it leaves the candidates only.
	rest := []*Backend{bs[0], bs[1], bs[3]}
	for i := range 1000 {
		after := p.Select(rest, Hint{Prefix: prompt(i)}).Name
		if before[i] != "b2" && after != before[i] {
			t.Fatalf("prompt %d moved from %s to %s though %s is still there", i, before[i], after, before[i])
		}
	}
}

func TestPrefixAffinityBoundedLoadWalksOn(t *testing.T) {
	bs := testBackends(0, 0, 0, 0)
	p := NewPrefixAffinity(256)
	h := Hint{Prefix: prompt(7)}
	home := p.Select(bs, h)
	// Load the home backend above 1.25*(average+1): with 20 on home and 0
	// elsewhere the average is 5 and the bound 7.5.
	home.st.inflight.Store(20)
	next := p.Select(bs, h)
	if next == home {
		t.Fatalf("picked overloaded home %s (inflight 20)", home.Name)
	}
	// Within the bound (1 <= 1.25*(0.25+1)) the home keeps the prefix.
	home.st.inflight.Store(1)
	if got := p.Select(bs, h); got != home {
		t.Errorf("pick = %s, want home %s within the load bound", got.Name, home.Name)
	}
}

func TestPrefixAffinityWithoutPrefixFallsBackToLeastInflight(t *testing.T) {
	bs := testBackends(3, 0, 5)
	if got := NewPrefixAffinity(256).Select(bs, Hint{}); got.Name != "b1" {
		t.Errorf("pick = %s, want b1 (least in flight)", got.Name)
	}
}

func TestPrefixAffinityAgreesAcrossInstances(t *testing.T) {
	// Proxy replicas each build their own ring; the same prompt must land on the same
	// backend everywhere, so the hash cannot be seeded per process.
	a, b := NewPrefixAffinity(256), NewPrefixAffinity(256)
	bs := testBackends(0, 0, 0)
	for i := range 100 {
		h := Hint{Prefix: prompt(i)}
		if x, y := a.Select(bs, h), b.Select(bs, h); x != y {
			t.Fatalf("prompt %d: %s vs %s", i, x.Name, y.Name)
		}
	}
}

func TestNewPolicyKnowsEveryConfiguredName(t *testing.T) {
	for _, name := range routerconfig.PolicyNames() {
		if _, ok := NewPolicy(name, 0); !ok {
			t.Errorf("NewPolicy(%q) failed", name)
		}
	}
	if _, ok := NewPolicy("nope", 0); ok {
		t.Error("NewPolicy accepted an unknown name")
	}
}
