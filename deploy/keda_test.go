package deploy

import (
	"context"
	"net/url"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// scaledObject is the part of KEDA's ScaledObject (keda.sh/v1alpha1) that the manifests use.
// KEDA's Go types are no dependency of this module; decodeStrict refuses a field that is not
// here, so a misspelt one fails as it does for the Kubernetes types.
type scaledObject struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              scaledObjectSpec `json:"spec"`
}

type scaledObjectSpec struct {
	ScaleTargetRef scaleTarget `json:"scaleTargetRef"`
	// PollingInterval is how often KEDA runs the query, in seconds. [30]
	PollingInterval *int32 `json:"pollingInterval,omitempty"`
	// MinReplicaCount and MaxReplicaCount bound the target's replicas. [0 and 100]
	MinReplicaCount *int32        `json:"minReplicaCount,omitempty"`
	MaxReplicaCount *int32        `json:"maxReplicaCount,omitempty"`
	Advanced        *kedaAdvanced `json:"advanced,omitempty"`
	Triggers        []kedaTrigger `json:"triggers"`
}

type scaleTarget struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Name       string `json:"name"`
}

type kedaAdvanced struct {
	HorizontalPodAutoscalerConfig *struct {
		// Behavior is the behavior of the HPA KEDA makes, the Kubernetes type itself.
		Behavior *autoscalingv2.HorizontalPodAutoscalerBehavior `json:"behavior,omitempty"`
	} `json:"horizontalPodAutoscalerConfig,omitempty"`
}

type kedaTrigger struct {
	Type string `json:"type"`
	// MetricType is the target's type in the HPA: AverageValue (KEDA's default), Value or
	// Utilization.
	MetricType autoscalingv2.MetricTargetType `json:"metricType,omitempty"`
	Metadata   map[string]string              `json:"metadata"`
}

// prometheusMetadata are the keys of KEDA's Prometheus scaler: metadata is a map, which a
// strict decoding cannot check, so a key outside these (a misspelt threshold) fails here.
var prometheusMetadata = []string{
	"serverAddress", "query", "threshold", "activationThreshold", "queryParameters", "namespace",
	"customHeaders", "ignoreNullValues", "unsafeSsl", "authModes",
}

// hpaDefaultScaleDown is the HPA's own scale-down stabilization window: engines that take
// minutes to load a model are never scaled in faster than a stateless Deployment.
const hpaDefaultScaleDown = 300

var (
	// saturationQuery is one aggregate, with no grouping, of the role's saturation: KEDA
	// wants a query that answers one element.
	saturationQuery = regexp.MustCompile(`^\s*(avg|max)\s*\(\s*pdproxy_pool_saturation\s*\{\s*role\s*=\s*"([a-z]+)"\s*\}\s*\)\s*$`)
)

// TestScaledObjectsScaleEachRolesEnginesOnItsSaturation: one KEDA ScaledObject per role,
// each scaling the Deployment of the engines that the standalone config's backends of that
// role discover (the headless Service's name), by a Prometheus query of that role's
// pdproxy_pool_saturation, which a running proxy exports; as a Value (the saturation is a
// ratio), aiming below 1, never down to no engine, scaling in no faster than an HPA does.
func TestScaledObjectsScaleEachRolesEnginesOnItsSaturation(t *testing.T) {
	ms := loadManifests(t)
	exported := saturationRoles(t)

	sos, files := all[scaledObject](ms)
	seen := map[routerconfig.Role]string{}
	for i, so := range sos {
		t.Run(files[i]+"/"+so.Name, func(t *testing.T) {
			if len(so.Spec.Triggers) != 1 {
				t.Fatalf("%d triggers, want one: the role's saturation", len(so.Spec.Triggers))
			}
			tr := so.Spec.Triggers[0]
			if tr.Type != "prometheus" {
				t.Fatalf("trigger type %q, want prometheus", tr.Type)
			}
			for k := range tr.Metadata {
				if !slices.Contains(prometheusMetadata, k) {
					t.Errorf("metadata %q is no key of KEDA's Prometheus scaler (%v)", k, prometheusMetadata)
				}
			}
			q := tr.Metadata["query"]
			m := saturationQuery.FindStringSubmatch(q)
			if m == nil {
				t.Fatalf("query %q: want avg(pdproxy_pool_saturation{role=\"ROLE\"}), one element for KEDA", q)
			}
			role := routerconfig.Role(m[2])
			if role != routerconfig.RolePrefill && role != routerconfig.RoleDecode {
				t.Fatalf("query %q: role %q is neither %s nor %s", q, role, routerconfig.RolePrefill, routerconfig.RoleDecode)
			}
			if other, dup := seen[role]; dup {
				t.Errorf("%s scales the %s engines too", other, role)
			}
			seen[role] = so.Name
			if !exported[role] {
				t.Errorf("query %q: a running proxy exports no pdproxy_pool_saturation{role=%q}", q, role)
			}

			// The target: the Deployment behind the Service the config's backends of the role
			// discover, which is not in deploy/ (the engines are yours) but is named by it.
			ref := so.Spec.ScaleTargetRef
			dir := filepath.Dir(filepath.Dir(files[i])) // the manifests the ScaledObjects go with
			engines := engineServices(t, ms, dir, role)
			if ref.APIVersion != "apps/v1" || ref.Kind != "Deployment" || !slices.Contains(engines, ref.Name) {
				t.Errorf("scaleTargetRef %s %s %s: want the Deployment apps/v1 of the %s engines, named as the Service the config discovers them by (%v)",
					ref.APIVersion, ref.Kind, ref.Name, role, engines)
			}
			if slices.ContainsFunc(proxyPods(t, ms), func(p proxyPod) bool { return filepath.Dir(p.file) == dir && p.dep.Name == ref.Name }) {
				t.Errorf("scaleTargetRef %s is the proxy's Deployment: the saturation is the engines'", ref.Name)
			}

			if tr.MetricType != autoscalingv2.ValueMetricType {
				t.Errorf("metricType %q, want %s: with AverageValue the HPA reads the saturation as a total to share among the engines and asks for ceil(saturation / threshold) of them",
					tr.MetricType, autoscalingv2.ValueMetricType)
			}
			threshold, err := strconv.ParseFloat(tr.Metadata["threshold"], 64)
			if err != nil || threshold <= 0 || threshold >= 1 {
				t.Errorf("threshold %q: want a saturation above 0 and below 1, so that engines come before requests wait", tr.Metadata["threshold"])
			}
			if a, ok := tr.Metadata["activationThreshold"]; ok {
				if v, err := strconv.ParseFloat(a, 64); err != nil || v < 0 || v >= threshold {
					t.Errorf("activationThreshold %q: want 0 or more, below the threshold %v", a, threshold)
				}
			}
			if u, err := url.Parse(tr.Metadata["serverAddress"]); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				t.Errorf("serverAddress %q is no http(s) URL of a Prometheus", tr.Metadata["serverAddress"])
			}
			if v := tr.Metadata["ignoreNullValues"]; v != "" && v != "false" {
				t.Errorf("ignoreNullValues %q: a Prometheus that lost the proxies would read as saturation 0 and scale the engines in", v)
			}

			lo, hi := so.Spec.MinReplicaCount, so.Spec.MaxReplicaCount
			if lo == nil || *lo < 1 {
				t.Errorf("minReplicaCount %v: want 1 or more; with no engine the proxy exports no saturation for the role, and nothing would scale it up again", deref(lo))
			}
			if hi == nil || lo == nil || *hi < *lo {
				t.Errorf("maxReplicaCount %v below minReplicaCount %v", deref(hi), deref(lo))
			}
			var down *int32
			if a := so.Spec.Advanced; a != nil && a.HorizontalPodAutoscalerConfig != nil && a.HorizontalPodAutoscalerConfig.Behavior != nil &&
				a.HorizontalPodAutoscalerConfig.Behavior.ScaleDown != nil {
				down = a.HorizontalPodAutoscalerConfig.Behavior.ScaleDown.StabilizationWindowSeconds
			}
			if down != nil && *down < hpaDefaultScaleDown {
				t.Errorf("scaleDown.stabilizationWindowSeconds %d: engines would be scaled in faster than the HPA's default %d s", *down, hpaDefaultScaleDown)
			}
		})
	}
	for _, role := range []routerconfig.Role{routerconfig.RolePrefill, routerconfig.RoleDecode} {
		if _, ok := seen[role]; !ok {
			t.Errorf("no ScaledObject scales the %s engines", role)
		}
	}
}

// engineServices are the hosts of the URLs of the role's backends in the config of the
// standalone proxy of dir: the Services whose engines the proxy discovers.
func engineServices(t *testing.T, ms manifests, dir string, role routerconfig.Role) []string {
	t.Helper()
	var hosts []string
	for _, p := range standalonePods(t, ms) {
		if filepath.Dir(p.file) != dir {
			continue
		}
		cfg, err := app.ParseConfig([]byte(proxyConfigData(t, &p)))
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range cfg.Router.Backends {
			if b.Role != role {
				continue
			}
			host, _, err := hostPort(b.URL)
			if err != nil {
				t.Fatal(err)
			}
			// A Service in another namespace is name.namespace: the Deployment is name.
			name, _, _ := strings.Cut(host, ".")
			hosts = append(hosts, name)
		}
	}
	if len(hosts) == 0 {
		t.Fatalf("no standalone proxy in %s/ has a %s backend", dir, role)
	}
	return hosts
}

// saturationRoles starts the embedded default (a simulated prefiller and decoder) and reads
// which roles it exports pdproxy_pool_saturation for.
func saturationRoles(t *testing.T) map[routerconfig.Role]bool {
	t.Helper()
	cfg := app.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.ShutdownTimeout = 2 * time.Second
	m, err := app.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := m.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	}()
	out := map[routerconfig.Role]bool{}
	for _, role := range []routerconfig.Role{routerconfig.RolePrefill, routerconfig.RoleDecode} {
		_, out[role] = testutil.Lookup(t, m.Registry, "pdproxy_pool_saturation", map[string]string{"role": string(role)})
	}
	return out
}
