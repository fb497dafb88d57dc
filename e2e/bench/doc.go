// Package bench measures what pdproxy costs: every figure is the proxy against a direct call
// to the same fast backend in the same run, since the machine is shared and noisy. It holds
// Go benchmarks (bench_test.go, in-process) and a vegeta-driven harness (harness_test.go,
// with the proxy in a process of its own so that its CPU and memory can be read apart). A
// tiny version of the harness runs with every `go test`, so that it cannot rot;
// PDPROXY_BENCH=full runs the real one. docs/benchmarks.md holds the
// figures and the commands that produced them.
package bench
