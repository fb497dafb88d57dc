// Package testutil owns what pdproxy's tests share to observe the code under test without
// racing it or the wall clock: reading metrics the way a scrape would (from a
// prometheus.Gatherer, or from a /metrics endpoint over HTTP), a fake clock that moves only
// when a test says so, and waiting for a state or an event with a deadline.
//
// A deadline here only turns a hang into a failure; it measures nothing. A test asserts the
// state it waited for, never how long the wait took (a speed goal belongs in a benchmark).
package testutil
