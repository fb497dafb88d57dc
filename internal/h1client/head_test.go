package h1client

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestResponseHeadLimitsAreNetHTTPs runs heads of many lines, long lines and past the limit
// through both engine clients: the lean one takes what net/http's transport takes, and
// refuses, with a HeadTooLargeError, what it refuses.
func TestResponseHeadLimitsAreNetHTTPs(t *testing.T) {
	mib := strings.Repeat("a", 1<<20)
	for _, tc := range []struct {
		name  string
		limit int64 // zero: either client's default, 10 MiB
		h     http.HandlerFunc
		taken bool
	}{
		{"a head of 1,000 header lines is taken", 0, func(w http.ResponseWriter, _ *http.Request) {
			for i := range 1000 {
				w.Header().Set(fmt.Sprintf("X-H%d", i), "v")
			}
			io.WriteString(w, "ok")
		}, true},
		{"a header line of 1 MiB is taken", 0, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("X-Big", mib)
			io.WriteString(w, "ok")
		}, true},
		{"a head of 11 MiB is refused", 0, func(w http.ResponseWriter, _ *http.Request) {
			for i := range 11 {
				w.Header().Set(fmt.Sprintf("X-Big%d", i), mib)
			}
			io.WriteString(w, "ok")
		}, false},
		{"a head over a set limit is refused", 64 << 10, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("X-Big", strings.Repeat("a", 100<<10))
			io.WriteString(w, "ok")
		}, false},
		{"interim answers count toward the limit", 64 << 10, func(w http.ResponseWriter, _ *http.Request) {
			for range 10 {
				w.Header().Set("Link", "</a>; "+strings.Repeat("a", 10<<10))
				w.WriteHeader(http.StatusEarlyHints)
			}
			w.Header().Del("Link")
			io.WriteString(w, "ok")
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := server(t, tc.h)
			lean := New(Options{MaxResponseHeaderBytes: tc.limit})
			stdlib := &http.Transport{MaxResponseHeaderBytes: tc.limit}
			t.Cleanup(lean.CloseIdleConnections)
			t.Cleanup(stdlib.CloseIdleConnections)
			for name, rt := range map[string]http.RoundTripper{"lean": lean, "stdlib": stdlib} {
				req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
				resp, err := rt.RoundTrip(req)
				if err == nil {
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if string(b) != "ok" {
						t.Errorf("%s: body %q", name, b)
					}
				}
				if taken := err == nil; taken != tc.taken {
					t.Errorf("%s: taken %v (%v), want %v", name, taken, err, tc.taken)
				}
				var tl *HeadTooLargeError
				if name == "lean" && !tc.taken && !errors.As(err, &tl) {
					t.Errorf("lean: error %v, want a HeadTooLargeError", err)
				}
			}
		})
	}
}
