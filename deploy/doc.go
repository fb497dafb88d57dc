// Package deploy holds what it takes to run pdproxy on Kubernetes: the container image's
// Dockerfile, the manifests (kubernetes/: the proxy's replicas and the optional Redis they
// share, KEDA's autoscalers of the engines in kubernetes/keda/, and the llm-d sidecar
// variant in kubernetes/sidecar/) and a Grafana dashboard
// (grafana/pdproxy.json). It has no code; its tests decode every manifest strictly into the
// Kubernetes API types, start the proxy with each ConfigMap's config, start a redis-server
// with the Redis container's args, build the binary as the Dockerfile does, and check every
// metric the dashboard queries against a running proxy's /metrics, so none of it can rot.
package deploy
