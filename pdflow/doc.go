// Package pdflow serves one client request across the engines, once the HTTP front (package
// proxy) has admitted and parsed it: the prefill and the decode, or the paired legs of SGLang
// and Mooncake, the relay of the answer to the client as a chain of stages, the release of a
// KV hold nobody will decode (at once when the client leaves, or at its deadline), the
// migration of a stream whose decoder failed, and the retries on a fresh pair. Each request
// is an Exchange; the Flow keeps what outlives one: the work that goes on after a client
// left, the bootstrap servers of paired prefillers, the recent aborts, the request metrics.
// The requests themselves are in the lifecycle table, the backends are the router's.
package pdflow
