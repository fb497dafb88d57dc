package app

import (
	"net/http"
	"net/http/pprof"
)

// adminHandler serves the Go profiler. Its handlers sit on a mux of their own: importing
// net/http/pprof also registers them on http.DefaultServeMux, which nothing here serves,
// so they never reach the proxy's listener.
func adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index) // and every named profile: heap, allocs, goroutine...
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}
