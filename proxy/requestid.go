package proxy

// A request's id, and the check that a header value the proxy keeps is printable ASCII.

import (
	"net/http"

	"github.com/pdproxy/pdproxy/api"
)

// requestID is the client's X-Request-Id when it sent a usable one, else a new random id.
func requestID(r *http.Request) string {
	if id := r.Header.Get("X-Request-Id"); id != "" && len(id) <= 128 && printable(id) {
		return id
	}
	return api.NewID()
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
