package pdflow

import (
	"fmt"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/lifecycle"
)

func TestAbortRingKeepsTheLastNewestFirst(t *testing.T) {
	rec := func(i int) AbortRecord { return AbortRecord{ID: fmt.Sprint(i)} }
	ids := func(rs []AbortRecord) string {
		var out []string
		for _, r := range rs {
			out = append(out, r.ID)
		}
		return strings.Join(out, ",")
	}
	for _, tc := range []struct {
		name  string
		added int
		want  string
	}{
		{"empty is an empty list", 0, ""},
		{"fewer than it keeps: all, newest first", 2, "1,0"},
		{"exactly full", 3, "2,1,0"},
		{"past full: the oldest drop out", 7, "6,5,4"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newAbortRing(3)
			for i := range tc.added {
				r.add(rec(i))
			}
			got := r.list()
			if got == nil || ids(got) != tc.want {
				t.Errorf("list() = %q (nil %v), want %q", ids(got), got == nil, tc.want)
			}
		})
	}
	t.Run("a late client-gone on an ended request is no abort", func(t *testing.T) {
		r := newAbortRing(3)
		r.add(AbortRecord{ID: "late", Stage: lifecycle.Aborted})
		if got := r.list(); len(got) != 0 {
			t.Errorf("list() = %+v, want nothing", got)
		}
	})
}
