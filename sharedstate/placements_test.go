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
		got, err := b.Placements(ctx, []Head{{"decode", "head-1"}, {"decode", "head-2"}, {"decode", "head-3"}})
		return err == nil && slices.Equal(got, want), fmt.Sprintf("placements another replica reads: %q, %v; want %q", got, err, want)
	})
	if got, err := b.Placements(ctx, []Head{{"prefill", "head-1"}, {"prefill", "head-2"}}); err != nil || !slices.Equal(got, []string{"prefiller-0", ""}) {
		t.Errorf("prefill placements = %q, %v; want each role its own", got, err)
	}
	if got, err := b.Placements(ctx, []Head{{"prefill", "head-1"}, {"decode", "head-1"}}); err != nil || !slices.Equal(got, []string{"prefiller-0", "decoder-2"}) {
		t.Errorf("both roles' placements in one read = %q, %v", got, err)
	}
	b.Place(Head{"decode", "head-1"}, "decoder-0", time.Minute)
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		got, err := a.Placements(ctx, []Head{{"decode", "head-1"}, {"decode", "head-2"}})
		return err == nil && slices.Equal(got, []string{"decoder-0", ""}), fmt.Sprintf("after a later placement and head-2's TTL: %q, %v", got, err)
	})
}

// A head is hashed under the prefix, bounded whatever its key, and a Placements call reads at
// most 8 heads; an engine name too long to be one is not kept.
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
		got, err := r.Placements(ctx, keys)
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
	if _, err := r.Placements(ctx, []Head{{"decode", "head"}}); err == nil {
		t.Fatal("Placements with Redis stopped answered no error")
	}
	if _, err := r.Placements(ctx, []Head{{"decode", "head"}}); err != ErrUnavailable {
		t.Errorf("the next read = %v, want ErrUnavailable while the store backs off", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("two reads with Redis stopped took %v", d)
	}
	if n := r.errors("placements"); n < 2 {
		t.Errorf("errors{placements} = %v, want 2", n)
	}
}
