package router

import (
	"context"
	"fmt"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"go.uber.org/zap"
)

// BenchmarkAcquireRelease measures the router's per-request cost with each policy, from
// parallel goroutines as the proxy calls it.
func BenchmarkAcquireRelease(b *testing.B) {
	for _, policy := range routerconfig.PolicyNames() {
		b.Run(policy, func(b *testing.B) {
			r, err := New(routerconfig.Config{
				Backends:     backendsCfg(routerconfig.RoleDecode, "d", 8, 1<<20),
				DecodePolicy: policy,
				Health:       routerconfig.HealthConfig{Interval: -1},
				// precise_cache_aware insists on a source of events; nothing runs it here.
				KVEvents: routerconfig.KVEventsConfig{Listen: "tcp://127.0.0.1:0"},
			}, zap.NewNop(), nil)
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					i++
					l, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{Prefix: fmt.Sprint("prompt ", i%64), Text: fmt.Sprint("prompt ", i%64)})
					if err != nil {
						b.Error(err)
						return
					}
					l.Release(Result{Status: 200})
				}
			})
		})
	}
}
