// Package router owns the engines the proxy talks to: the backend pools per role
// (prefill, decode), their health (active checks and passive ejection), the selection
// policies, the in-flight accounting of every request sent to a backend, and the
// backpressure queue that holds a request while every eligible backend is full.
//
// The proxy asks for a backend with [Router.Acquire] and gets a [Lease]; the lease counts
// one in-flight request on the backend until [Lease.Release], which also feeds passive
// health. The router never calls back into the proxy and sends no request itself except
// its health checks (each one that passes followed, for a backend whose models are not
// configured, by GET /v1/models) and, for the policies that weigh the engines' load
// (least_loaded and the cache-aware ones), its scrapes of the engines' /metrics, which
// [Router.Run] owns, as it owns the KV event subscribers of precise_cache_aware.
// [Router.Tokens] picks the backend to tokenize at and leaves the call to the
// [routerconfig.Tokenizer] it was given ([routerconfig.Config.EngineTokenizer]), which
// knows the engines, except for the models it has a [routerconfig.LocalTokenizer] of
// ([routerconfig.Config.LocalTokenizers]): those it tokenizes itself once
// [Router.CheckTokenizers] found an engine that agrees with it.
//
// Proxy replicas behind one Service route alone; the router makes them agree without a
// message between them where it can (placement.go): a prompt no engine caches, and a
// session ([Hint.Session]), go where the rendezvous order of their key with bounded loads
// puts them, and the load every policy that weighs one reads is the engines' own report
// plus only this replica's requests since (load.go).
//
// Its configuration, the keys, their defaults and their checks, is package routerconfig's.
package router
