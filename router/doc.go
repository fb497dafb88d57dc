// Package router owns the engines the proxy talks to: the backend pools per role
// (prefill, decode), their health (active checks and passive ejection), the selection
// policies, the in-flight accounting of every request sent to a backend, and the
// backpressure queue that holds a request while every eligible backend is full.
//
// The proxy asks for a backend with [Router.Acquire] and gets a [Lease]; the lease counts
// one in-flight request on the backend until [Lease.Release], which also feeds passive
// health. The router never calls back into the proxy and never sends a request itself,
// except its own health checks.
package router
