package router

import (
	"reflect"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestLeasesSpreadOverADataParallelEnginesRanks(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: []routerconfig.BackendConfig{
		{Name: "d0", URL: "http://d0:8000", Role: routerconfig.RoleDecode, DataParallelSize: 3},
		{Name: "d1", URL: "http://d1:8000", Role: routerconfig.RoleDecode},
	}})
	var leases []*Lease
	ranksOf := map[string][]int{}
	for range 8 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
		leases = append(leases, l)
		if rank, ok := l.Rank(); ok {
			ranksOf[l.Backend().Name] = append(ranksOf[l.Backend().Name], rank)
		} else if l.Backend().Name == "d0" {
			t.Fatal("a lease on a 3-rank engine took no rank")
		}
	}
	if got := ranksOf["d1"]; got != nil {
		t.Errorf("an engine of one rank gave ranks %v", got)
	}
	counts := map[int]int{}
	for _, rank := range ranksOf["d0"] {
		counts[rank]++
	}
	for rank, n := range counts {
		for other, m := range counts {
			if n-m > 1 {
				t.Errorf("rank %d has %d leases, rank %d %d: want them even", rank, n, other, m)
			}
		}
	}
	var status []RankStatus
	for _, b := range r.Backends() {
		if b.Name == "d0" {
			status = b.Ranks
		}
	}
	var sum int64
	for _, s := range status {
		sum += s.Inflight
	}
	if len(status) != 3 || sum != int64(len(ranksOf["d0"])) {
		t.Errorf("/debug/backends ranks %+v, want 3 ranks counting %d leases", status, len(ranksOf["d0"]))
	}
	for _, l := range leases {
		l.Release(Result{})
	}
	for _, b := range r.Backends() {
		if b.Name == "d0" && !reflect.DeepEqual(b.Ranks, []RankStatus{{0, 0}, {1, 0}, {2, 0}}) {
			t.Errorf("after every release: ranks %+v, want all at 0", b.Ranks)
		}
	}
}
