package sharedstate

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// Where one replica placed a prompt's heads, another reads, per role, until the TTL; the
// latest placement wins; a head nobody placed reads as none.
func TestAPlacementOneReplicaMadeIsReadByAnother(t *testing.T) {
	srv := redistest.Start(t)
	a, b := startReplica(t, srv.Addr(), Config{}), startReplica(t, srv.Addr(), Config{})
	ctx := context.Background()
	a.Place(Head{"decode", "head-1"}, "decoder-2", time.Minute)
	a.Place(Head{"prefill", "head-1"}, "prefiller-0", time.Minute)
	a.Place(Head{"decode", "head-2"}, "decoder-1", 300*time.Millisecond)
	want := []string{"decoder-2", "decoder-1", ""}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		got, err := headsOnly(b.Placements(ctx, []Head{{"decode", "head-1"}, {"decode", "head-2"}, {"decode", "head-3"}}, nil))
		return err == nil && slices.Equal(got, want), fmt.Sprintf("placements another replica reads: %q, %v; want %q", got, err, want)
	})
	if got, err := headsOnly(b.Placements(ctx, []Head{{"prefill", "head-1"}, {"prefill", "head-2"}}, nil)); err != nil || !slices.Equal(got, []string{"prefiller-0", ""}) {
		t.Errorf("prefill placements = %q, %v; want each role its own", got, err)
	}
	if got, err := headsOnly(b.Placements(ctx, []Head{{"prefill", "head-1"}, {"decode", "head-1"}}, nil)); err != nil || !slices.Equal(got, []string{"prefiller-0", "decoder-2"}) {
		t.Errorf("both roles' placements in one read = %q, %v", got, err)
	}
	b.Place(Head{"decode", "head-1"}, "decoder-0", time.Minute)
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		got, err := headsOnly(a.Placements(ctx, []Head{{"decode", "head-1"}, {"decode", "head-2"}}, nil))
		return err == nil && slices.Equal(got, []string{"decoder-0", ""}), fmt.Sprintf("after a later placement and head-2's TTL: %q, %v", got, err)
	})
}

// A head is hashed under the prefix, bounded whatever its key, and a Placements call reads at
// most 16 heads; an engine name too long to be one is not kept.
func TestPlacementsAreBounded(t *testing.T) {
	srv := redistest.Start(t)
	r := startReplica(t, srv.Addr(), Config{})
	ctx := context.Background()
	long := strings.Repeat("x", 1<<16)
	r.Place(Head{"decode", long}, "decoder-0", time.Minute)
	r.Place(Head{"decode", "head"}, strings.Repeat("d", maxBindingBytes+1), time.Minute)
	keys := make([]Head, 20)
	for i := range keys {
		keys[i] = Head{"decode", long}
	}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		got, err := headsOnly(r.Placements(ctx, keys, nil))
		return err == nil && len(got) == maxPlacementKeys && got[0] == "decoder-0", fmt.Sprintf("placements of 20 heads: %d answers, %v", len(got), err)
	})
	if n, err := srv.Do("DBSIZE"); err != nil || n != ":1" {
		t.Errorf("DBSIZE = %s, %v; want the one placement kept", n, err)
	}
	k := r.headKey(Head{"decode", long})
	if !strings.HasPrefix(k, "pdproxy:head:") || len(k) > 64 {
		t.Errorf("head key %q: want the prefix and a hash", k)
	}
}

// With Redis gone a read answers at once with an error, counted, and the back-off answers
// the next ones without asking; the caller routes on its own view.
func TestPlacementsWithRedisStoppedFailFast(t *testing.T) {
	srv := redistest.Start(t)
	r := startReplica(t, srv.Addr(), Config{})
	srv.Stop()
	ctx := context.Background()
	start := time.Now()
	if _, err := headsOnly(r.Placements(ctx, []Head{{"decode", "head"}}, nil)); err == nil {
		t.Fatal("Placements with Redis stopped answered no error")
	}
	if _, err := headsOnly(r.Placements(ctx, []Head{{"decode", "head"}}, nil)); err != ErrUnavailable {
		t.Errorf("the next read = %v, want ErrUnavailable while the store backs off", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("two reads with Redis stopped took %v", d)
	}
	if n := r.errors("placements"); n < 2 {
		t.Errorf("errors{placements} = %v, want 2", n)
	}
}

// headsOnly is what Placements answers of the heads alone.
func headsOnly(placed []string, _ []float64, err error) ([]string, error) { return placed, err }

// The uncached tokens every replica sent each engine lately are read by any replica, per
// role, in the same round trip as the heads: the sum of what each sent, counted from the
// window of the last 30 s and the one before it.
func TestTheTokensReplicasSentEachEngineAreReadByAnother(t *testing.T) {
	srv := redistest.Start(t)
	a, b := startReplica(t, srv.Addr(), Config{}), startReplica(t, srv.Addr(), Config{})
	ctx := context.Background()
	a.AddSent("decode", "decoder-0", 1000)
	b.AddSent("decode", "decoder-0", 500)
	a.AddSent("decode", "decoder-1", 200)
	a.AddSent("prefill", "decoder-1", 7000) // another pool's engine of the same name
	a.AddSent("decode", "decoder-2", 0)     // nothing to count
	a.Place(Head{"decode", "head"}, "decoder-1", time.Minute)
	engines := []Sent{{"decode", "decoder-0"}, {"decode", "decoder-1"}, {"decode", "decoder-2"}, {"prefill", "decoder-1"}}
	// Within a window the counts are whole; a read just past a window's end weighs the one
	// before by what is left of it, nearly whole.
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		placed, sent, err := b.Placements(ctx, []Head{{"decode", "head"}}, engines)
		ok := err == nil && slices.Equal(placed, []string{"decoder-1"}) && len(sent) == 4 &&
			sent[0] >= 750 && sent[0] <= 1500 && sent[1] >= 100 && sent[1] <= 200 && sent[2] == 0 && sent[3] >= 3500 && sent[3] <= 7000
		return ok, fmt.Sprintf("another replica reads placed %q, sent %v, %v", placed, sent, err)
	})
	if _, sent, err := a.Placements(ctx, nil, []Sent{{"decode", "decoder-9"}}); err != nil || len(sent) != 1 || sent[0] != 0 {
		t.Errorf("an engine nobody sent anything: sent %v, %v; want 0", sent, err)
	}
	if n, _ := srv.Do("EVAL", "local n = 0 for _, k in ipairs(redis.call('KEYS', '*')) do if redis.call('PTTL', k) > 0 then n = n + 1 end end return n", "0"); n != ":3" {
		t.Errorf("%s keys with a TTL, want 3: the placement and the two pools' windows", n)
	}
	many := make([]Sent, 40)
	for i := range many {
		many[i] = Sent{"decode", "decoder-0"}
	}
	if _, sent, err := a.Placements(ctx, nil, many); err != nil || len(sent) != maxSentEngines {
		t.Errorf("40 engines asked: %d answers, %v; want %d", len(sent), err, maxSentEngines)
	}
}
