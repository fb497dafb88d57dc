// Package h1client is a lean HTTP/1.1 client for engine backends, an http.RoundTripper the
// router puts in a backend's http.Client in place of net/http's transport (engine_client:
// lean). What it leaves out is what a proxy's hot path pays for in net/http's transport and
// never uses: the per-connection read and write loop goroutines and their channel hand-offs
// (the response is read on the caller's goroutine), HTTP/2, proxies, compression, redirects.
// A request goes out in one write; connections are pooled per host and reused only after a
// body was read to its end and the server did not ask to close; an abort is the request's
// context closing its connection (one context.AfterFunc), which is how an engine learns of it.
// A response is read as net/http's transport reads it, limits included, so that a backend
// gets the same answer from either engine client; response.go lists the few places where it
// is stricter, and FuzzParseHead holds it to both.
package h1client
