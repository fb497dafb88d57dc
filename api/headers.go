package api

import (
	"net/http"
	"net/textproto"
	"strings"
)

// hopHeaders are per-connection headers (RFC 9110 section 7.6.1) that a proxy must not pass on,
// plus what the proxy sets itself.
var hopHeaders = map[string]bool{
	"Connection": true, "Proxy-Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true,
	"Proxy-Authorization": true, "Te": true, "Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
	"Content-Length": true, "Content-Type": true, "Accept-Encoding": true, "Host": true, "X-Request-Id": true,
	"X-Client-Request-Id": true,
}

// UpstreamHeader is what of the client's headers goes to the backends. Headers that other P/D
// sidecars read to pick an upstream (x-prefiller-host-port and the like) are dropped:
// upstreams come from config only, never from a request. So are the headers the client's
// Connection header names: they were for the hop to the proxy alone (RFC 9110 section 7.6.1).
func UpstreamHeader(in http.Header) http.Header {
	out := make(http.Header, len(in))
	for k, v := range in {
		if hopHeaders[k] {
			continue
		}
		lk := strings.ToLower(k)
		if strings.HasPrefix(lk, "x-prefiller") || strings.HasPrefix(lk, "x-decoder") || strings.HasPrefix(lk, "x-forwarded-host") {
			continue
		}
		out[k] = v
	}
	for _, line := range in["Connection"] {
		for name := range strings.SplitSeq(line, ",") {
			if name = textproto.TrimString(name); name != "" {
				delete(out, http.CanonicalHeaderKey(name))
			}
		}
	}
	return out
}
