package deploy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"
	yamlv3 "gopkg.in/yaml.v3"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// manifestDir holds the Kubernetes manifests: the standalone proxy at the top, the llm-d
// sidecar variant in sidecar/.
const manifestDir = "kubernetes"

// proxyContainerName is the name of the pdproxy container in every pod that runs it.
const proxyContainerName = "pdproxy"

// afterDrain is how long the proxy may still take once shutdown_timeout has passed: up to
// 5 s for the handlers it aborted to return, then up to 10 s for KV releases to reach the
// engines (cmd/proxy/app, Main.Shutdown). A grace period must cover it too, or the kubelet's
// SIGKILL cuts the releases that free prefillers' KV.
const afterDrain = 15 * time.Second

// kinds are the API types the manifests may use, by apiVersion and kind.
var kinds = map[string]func() any{
	"v1/ConfigMap":                           func() any { return new(corev1.ConfigMap) },
	"v1/Service":                             func() any { return new(corev1.Service) },
	"apps/v1/Deployment":                     func() any { return new(appsv1.Deployment) },
	"policy/v1/PodDisruptionBudget":          func() any { return new(policyv1.PodDisruptionBudget) },
	"autoscaling/v2/HorizontalPodAutoscaler": func() any { return new(autoscalingv2.HorizontalPodAutoscaler) },
	"networking.k8s.io/v1/NetworkPolicy":     func() any { return new(networkingv1.NetworkPolicy) },
	"keda.sh/v1alpha1/ScaledObject":          func() any { return new(scaledObject) },
}

// splitDocuments splits a multi-document YAML file on its "---" lines, dropping documents
// that hold only comments or blank lines.
func splitDocuments(data []byte) [][]byte {
	var (
		docs [][]byte
		cur  bytes.Buffer
		real bool // cur has a line that is neither blank nor a comment
	)
	flush := func() {
		if real {
			docs = append(docs, bytes.Clone(cur.Bytes()))
		}
		cur.Reset()
		real = false
	}
	for _, line := range strings.SplitAfter(string(data), "\n") {
		trimmed := strings.TrimSpace(line)
		if trimmed == "---" {
			flush()
			continue
		}
		if trimmed != "" && !strings.HasPrefix(trimmed, "#") {
			real = true
		}
		cur.WriteString(line)
	}
	flush()
	return docs
}

// decodeStrict decodes one YAML document into the API type its apiVersion and kind name,
// failing on a field the type does not have (or has twice, or spells in another case), as
// `kubectl apply --validate=strict` does.
func decodeStrict(doc []byte) (any, error) {
	var tm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	newObj, ok := kinds[tm.APIVersion+"/"+tm.Kind]
	if !ok {
		return nil, fmt.Errorf("apiVersion %q, kind %q: not a type the manifests use", tm.APIVersion, tm.Kind)
	}
	// Not yaml.UnmarshalStrict: it decodes with encoding/json, which matches field names
	// case-insensitively, so "readinessprobe" would quietly fill readinessProbe. The API
	// server decodes with sigs.k8s.io/json, case-sensitively; so does this.
	js, err := yaml.YAMLToJSONStrict(doc) // fails on a duplicate key
	if err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	obj := newObj()
	strict, err := sigsjson.UnmarshalStrict(js, obj)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	if len(strict) > 0 {
		return nil, fmt.Errorf("%s: %w", tm.Kind, errors.Join(strict...))
	}
	return obj, nil
}

// manifests are every object of every file under kubernetes/, by file (relative to
// deploy/), in the files' order.
type manifests struct {
	files map[string][]any
	order []string
}

// loadManifests reads and strictly decodes every manifest; a document that fails fails the
// test.
func loadManifests(t *testing.T) manifests {
	t.Helper()
	ms := manifests{files: map[string][]any{}}
	err := filepath.WalkDir(manifestDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if ext := filepath.Ext(path); ext != ".yaml" && ext != ".yml" {
			return fmt.Errorf("%s: not a .yaml file; only manifests belong in %s/", path, manifestDir)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		docs := splitDocuments(data)
		if len(docs) == 0 {
			return fmt.Errorf("%s: no manifest in it", path)
		}
		for i, doc := range docs {
			obj, err := decodeStrict(doc)
			if err != nil {
				return fmt.Errorf("%s, document %d: %w", path, i+1, err)
			}
			ms.files[path] = append(ms.files[path], obj)
		}
		ms.order = append(ms.order, path)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

// all returns every object of type T, with the file it is in.
func all[T any](ms manifests) (objs []*T, files []string) {
	for _, f := range ms.order {
		for _, o := range ms.files[f] {
			if v, ok := o.(*T); ok {
				objs, files = append(objs, v), append(files, f)
			}
		}
	}
	return objs, files
}

// configMap returns the ConfigMap named name in the file's directory (where kubectl apply -f
// DIR puts them together).
func (ms manifests) configMap(dir, name string) *corev1.ConfigMap {
	cms, files := all[corev1.ConfigMap](ms)
	for i, cm := range cms {
		if cm.Name == name && filepath.Dir(files[i]) == dir {
			return cm
		}
	}
	return nil
}

func TestManifestsDecodeStrictlyIntoKubernetesTypes(t *testing.T) {
	ms := loadManifests(t)
	count := map[string]int{}
	for _, f := range ms.order {
		t.Run(f, func(t *testing.T) {
			for i, o := range ms.files[f] {
				count[fmt.Sprintf("%T", o)]++
				if name := objectName(o); name == "" {
					t.Errorf("document %d (%T) has no metadata.name", i+1, o)
				}
			}
		})
	}
	// What deploy/ must carry for a replicated, autoscaled proxy.
	for typ, min := range map[string]int{
		"*v1.Deployment": 2, "*v1.Service": 1, "*v1.PodDisruptionBudget": 1, "*v2.HorizontalPodAutoscaler": 1, "*v1.ConfigMap": 2,
		"*deploy.scaledObject": 2,
	} {
		if count[typ] < min {
			t.Errorf("%d %s in %s/, want at least %d", count[typ], typ, manifestDir, min)
		}
	}
}

func objectName(o any) string {
	switch v := o.(type) {
	case *corev1.ConfigMap:
		return v.Name
	case *corev1.Service:
		return v.Name
	case *appsv1.Deployment:
		return v.Name
	case *policyv1.PodDisruptionBudget:
		return v.Name
	case *autoscalingv2.HorizontalPodAutoscaler:
		return v.Name
	case *networkingv1.NetworkPolicy:
		return v.Name
	case *scaledObject:
		return v.Name
	}
	return ""
}

// TestStrictDecodingRejectsWhatKubectlWouldNot shows the decoding above is strict: a typo
// in a field name is an error, not a field silently dropped.
func TestStrictDecodingRejectsWhatKubectlWouldNot(t *testing.T) {
	tests := []struct {
		name, doc, want string
	}{
		{"a misspelt field", `
apiVersion: apps/v1
kind: Deployment
metadata: {name: x}
spec:
  template:
    spec:
      containers:
        - name: pdproxy
          readinessprobe: {httpGet: {path: /ready, port: 8000}}
`, "readinessprobe"},
		{"a field at the wrong level", `
apiVersion: v1
kind: Service
metadata: {name: x}
selector: {app: x}
`, "selector"},
		{"a field in another case", `
apiVersion: v1
kind: Service
metadata: {name: x}
spec:
  Selector: {app: x}
`, "Selector"},
		{"a duplicate field", `
apiVersion: v1
kind: ConfigMap
metadata: {name: x}
data: {a: b}
data: {c: d}
`, "data"},
		{"a ScaledObject field KEDA does not have", `
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata: {name: x}
spec:
  scaleTargetRef: {name: x}
  minReplicas: 1
`, "minReplicas"},
		{"a kind of another API version", `
apiVersion: autoscaling/v1
kind: HorizontalPodAutoscaler
metadata: {name: x}
`, "autoscaling/v1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := decodeStrict([]byte(tt.doc))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("decodeStrict = %v, want an error naming %q", err, tt.want)
			}
		})
	}
}

func TestSplitDocumentsSplitsOnSeparatorLines(t *testing.T) {
	in := "# header\n---\na: 1\n---  \n# only a comment\n---\nb: 2\nc: '---'\n"
	got := splitDocuments([]byte(in))
	want := []string{"a: 1\n", "b: 2\nc: '---'\n"}
	if len(got) != len(want) {
		t.Fatalf("%d documents %q, want %q", len(got), got, want)
	}
	for i := range want {
		if string(got[i]) != want[i] {
			t.Errorf("document %d = %q, want %q", i, got[i], want[i])
		}
	}
}

// proxyPod is a Deployment that runs pdproxy, with the config its ConfigMap gives it.
type proxyPod struct {
	file   string
	dep    *appsv1.Deployment
	proxy  *corev1.Container
	others []*corev1.Container // the engines beside it, in the sidecar variant
	// configFile is the --config path in the container; configData the ConfigMap's
	// content at it.
	configFile string
	configData string
}

// sidecarOnlyKeys are the sidecar variant's config keys (the prefiller named by llm-d's
// header, and the prefillers it may name), added to the proxy in a change of their own.
var sidecarOnlyKeys = []string{"prefiller_header", "prefiller_allow"}

// proxyPods finds every Deployment with a pdproxy container and reads the config its args
// and volumes give it.
func proxyPods(t *testing.T, ms manifests) []proxyPod {
	t.Helper()
	var pods []proxyPod
	deps, files := all[appsv1.Deployment](ms)
	for i, d := range deps {
		p := proxyPod{file: files[i], dep: d}
		spec := &d.Spec.Template.Spec
		for j := range spec.Containers {
			if c := &spec.Containers[j]; c.Name == proxyContainerName {
				p.proxy = c
			} else {
				p.others = append(p.others, c)
			}
		}
		if p.proxy == nil {
			continue
		}
		args := append(slices.Clone(p.proxy.Command), p.proxy.Args...)
		k := slices.Index(args, "--config")
		if k < 0 || k+1 >= len(args) {
			t.Fatalf("%s: container %s has no --config FILE in its args %v: it would start the embedded default, with simulated engines on loopback",
				p.file, p.proxy.Name, args)
		}
		p.configFile = args[k+1]
		p.configData = configFromVolumes(t, ms, p)
		pods = append(pods, p)
	}
	if len(pods) == 0 {
		t.Fatalf("no Deployment in %s/ has a container named %s", manifestDir, proxyContainerName)
	}
	return pods
}

// configFromVolumes is the content of p's --config file: the ConfigMap key that the
// container's volume mounts put there.
func configFromVolumes(t *testing.T, ms manifests, p proxyPod) string {
	t.Helper()
	for _, vm := range p.proxy.VolumeMounts {
		rel, ok := strings.CutPrefix(p.configFile, strings.TrimSuffix(vm.MountPath, "/")+"/")
		if !ok {
			continue
		}
		if vm.SubPath != "" {
			t.Errorf("%s: the config volume is mounted with subPath, which never sees a ConfigMap update", p.file)
		}
		for _, v := range p.dep.Spec.Template.Spec.Volumes {
			if v.Name != vm.Name || v.ConfigMap == nil {
				continue
			}
			cm := ms.configMap(filepath.Dir(p.file), v.ConfigMap.Name)
			if cm == nil {
				t.Fatalf("%s: volume %s names ConfigMap %s, which is not beside it", p.file, v.Name, v.ConfigMap.Name)
			}
			key := rel
			for _, it := range v.ConfigMap.Items {
				if it.Path == rel {
					key = it.Key
				}
			}
			data, ok := cm.Data[key]
			if !ok {
				t.Fatalf("%s: ConfigMap %s has no key %s for %s", p.file, cm.Name, key, p.configFile)
			}
			return data
		}
	}
	t.Fatalf("%s: no ConfigMap volume is mounted where --config %s points", p.file, p.configFile)
	return ""
}

// proxyConfigData is p's config as this branch's proxy can read it. The sidecar variant's
// config has prefiller_header and prefiller_allow, which another change is adding to the
// proxy. Until this branch has them, ParseConfig rejects them as unknown; then, and only for
// the sidecar variant (a pod whose pdproxy container has an engine beside it, and whose
// config sets both keys), the two keys are removed and the rest is validated. Once the keys
// exist, nothing is removed and the whole file is validated as it is.
func proxyConfigData(t *testing.T, p *proxyPod) string {
	t.Helper()
	_, err := app.ParseConfig([]byte(p.configData))
	if err == nil {
		return p.configData
	}
	var unknown []string
	for _, k := range sidecarOnlyKeys {
		if strings.Contains(err.Error(), "field "+k+" not found") {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) == 0 {
		t.Fatalf("%s: the config does not parse: %v", p.file, err)
	}
	var doc map[string]any
	if err := yamlv3.Unmarshal([]byte(p.configData), &doc); err != nil {
		t.Fatal(err)
	}
	// The explicit check that this is the sidecar config, the only one allowed keys this
	// proxy does not know yet.
	allow, _ := doc["prefiller_allow"].([]any)
	if len(p.others) == 0 || doc["prefiller_header"] != "x-prefiller-host-port" || len(allow) == 0 {
		t.Fatalf("%s: the config has %v, which this proxy does not know, and is not the sidecar variant's (a pod with an engine beside pdproxy, prefiller_header: x-prefiller-host-port and a non-empty prefiller_allow)",
			p.file, unknown)
	}
	for _, k := range sidecarOnlyKeys {
		delete(doc, k)
	}
	out, err := yamlv3.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: validated without %v: this branch's proxy does not have those keys yet", p.file, sidecarOnlyKeys)
	return string(out)
}

// TestProxyStartsWithEveryManifestsConfig starts pdproxy as each pod would: with the
// container's own args and its ConfigMap's file at the --config path (moved to a temporary
// directory), only --listen moved to a free loopback port. Start is where the proxy checks a
// config (flags, router validation, the KV hold rule, the proxy's modes, key files), so a
// ConfigMap that passes here is one the pod starts with. The engines' names do not resolve
// here; health checks fail quietly and are no part of the check. Nor does the Redis of
// shared_state: a replica must start and serve without it, on its own state, and say so
// once in its log however many requests it decides alone.
func TestProxyStartsWithEveryManifestsConfig(t *testing.T) {
	ms := loadManifests(t)
	for _, p := range proxyPods(t, ms) {
		t.Run(p.file, func(t *testing.T) {
			data := proxyConfigData(t, &p)
			dir := t.TempDir()
			file := filepath.Join(dir, filepath.Base(p.configFile))
			if err := os.WriteFile(file, []byte(data), 0o600); err != nil {
				t.Fatal(err)
			}
			args := append(slices.Clone(p.proxy.Command), p.proxy.Args...)
			args[slices.Index(args, "--config")+1] = file
			args = append(args, "--listen", "127.0.0.1:0")
			var stderr bytes.Buffer
			cfg, err := app.LoadConfig(args, &stderr)
			if err != nil {
				t.Fatalf("the container's args %v: %v\n%s", p.proxy.Args, err, stderr.String())
			}
			core, logs := observer.New(zap.WarnLevel)
			logger := zap.New(zapcore.NewTee(zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)).Core(), core))
			m, err := app.New(cfg, logger)
			if err != nil {
				t.Fatal(err)
			}
			if err := m.Start(context.Background()); err != nil {
				t.Fatalf("the proxy refuses the config: %v", err)
			}
			client := &http.Client{Transport: &http.Transport{}, Timeout: 20 * time.Second}
			defer func() {
				client.CloseIdleConnections()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				if err := m.Shutdown(ctx); err != nil {
					t.Errorf("shutdown: %v", err)
				}
			}()
			if code := get(t, client, m.URL()+"/health"); code != http.StatusOK {
				t.Fatalf("GET /health: %d", code)
			}
			if cfg.SharedState.Redis.Addr == "" {
				return
			}
			unreachable := func() int {
				return logs.FilterMessageSnippet("shared state unreachable").FilterField(zap.String("addr", cfg.SharedState.Redis.Addr)).Len()
			}
			testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
				return unreachable() > 0, "no warning that shared_state's Redis " + cfg.SharedState.Redis.Addr + " is unreachable"
			})
			// Requests that name a session, each checked against the Redis that is not there:
			// each is decided here, counted, and logged no more.
			headers := cfg.Proxy.SessionAffinity.Headers
			for i := range 5 {
				req, err := http.NewRequest(http.MethodPost, m.URL()+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"hello","max_tokens":1}`))
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set("Content-Type", "application/json")
				if len(headers) > 0 {
					req.Header.Set(headers[0], "session-"+strconv.Itoa(i))
				}
				resp, err := client.Do(req)
				if err != nil {
					t.Fatalf("a request while shared_state's Redis is unreachable: %v", err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			if checks := testutil.Value(t, m.Registry, "pdproxy_shared_state_errors_total", map[string]string{"op": "check"}); len(headers) > 0 && checks < 5 {
				t.Errorf("pdproxy_shared_state_errors_total{op=check} = %v after 5 requests naming a session, want each counted", checks)
			}
			if n := unreachable(); n != 1 {
				t.Errorf("the outage was logged %d times, want once", n)
			}
			if up := testutil.Value(t, m.Registry, "pdproxy_shared_state_up", nil); up != 0 {
				t.Errorf("pdproxy_shared_state_up = %v while Redis is unreachable, want 0", up)
			}
		})
	}
}

func get(t *testing.T, client *http.Client, url string) int {
	t.Helper()
	resp, err := client.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// TestProxyListensWhereThePodIsReached: the config's listener is on every interface and on
// the container's port, and the sidecar's decode backend is the engine beside it.
func TestProxyListensWhereThePodIsReached(t *testing.T) {
	ms := loadManifests(t)
	for _, p := range proxyPods(t, ms) {
		t.Run(p.file, func(t *testing.T) {
			cfg, err := app.ParseConfig([]byte(proxyConfigData(t, &p)))
			if err != nil {
				t.Fatal(err)
			}
			host, port, err := net.SplitHostPort(cfg.Listen)
			if err != nil {
				t.Fatalf("listen %q: %v", cfg.Listen, err)
			}
			if host != "" && host != "0.0.0.0" && host != "::" {
				t.Errorf("listen %q: the kubelet's probes and the Service reach the pod on its own IP, not on %s", cfg.Listen, host)
			}
			if cp := containerPort(p.proxy, intstr.FromString("http")); strconv.Itoa(int(cp)) != port {
				t.Errorf("listen %q, but the container's port http is %d", cfg.Listen, cp)
			}
			if len(p.others) == 0 {
				return
			}
			// The sidecar: its decoders are the engine in its own pod, on loopback.
			for _, b := range cfg.Router.Backends {
				if b.Role != routerconfig.RoleDecode {
					t.Errorf("backend %s: role %s; the sidecar's only backend is its own decoder (prefillers come from the header)", b.Name, b.Role)
					continue
				}
				host, port, err := hostPort(b.URL)
				if err != nil {
					t.Fatal(err)
				}
				if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
					t.Errorf("backend %s at %s: the sidecar's decoder is the engine in its own pod, on loopback", b.Name, b.URL)
				}
				if !slices.ContainsFunc(p.others, func(c *corev1.Container) bool { return hasPort(c, port) }) {
					t.Errorf("backend %s at %s: no container beside pdproxy has port %d", b.Name, b.URL, port)
				}
				if hasPort(p.proxy, port) {
					t.Errorf("backend %s at %s is pdproxy's own port", b.Name, b.URL)
				}
			}
		})
	}
}

func hostPort(rawURL string) (string, int32, error) {
	_, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		return "", 0, fmt.Errorf("%s: no scheme", rawURL)
	}
	rest, _, _ = strings.Cut(rest, "/")
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return "", 0, fmt.Errorf("%s: %w", rawURL, err)
	}
	n, err := strconv.ParseInt(port, 10, 32)
	return host, int32(n), err
}

func hasPort(c *corev1.Container, port int32) bool {
	return slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.ContainerPort == port })
}

// containerPort resolves a probe's or a Service's port (a number or a name) to the
// container's port number, or 0 when the container has no such port.
func containerPort(c *corev1.Container, port intstr.IntOrString) int32 {
	for _, p := range c.Ports {
		if (port.Type == intstr.String && p.Name == port.StrVal) || (port.Type == intstr.Int && p.ContainerPort == port.IntVal) {
			return p.ContainerPort
		}
	}
	return 0
}

// TestProxyPodsProbeReadyAndHealthAndStopGracefully: readiness on /ready (it fails while no
// decoder is healthy and once a drain begins), liveness on /health (the process only, so an
// engine outage never restarts proxies), and a stop that lets shutdown_timeout pass.
func TestProxyPodsProbeReadyAndHealthAndStopGracefully(t *testing.T) {
	ms := loadManifests(t)
	for _, p := range proxyPods(t, ms) {
		t.Run(p.file, func(t *testing.T) {
			cfg, err := app.ParseConfig([]byte(proxyConfigData(t, &p)))
			if err != nil {
				t.Fatal(err)
			}
			for _, pr := range []struct {
				kind  string
				probe *corev1.Probe
				path  string
			}{{"readinessProbe", p.proxy.ReadinessProbe, "/ready"}, {"livenessProbe", p.proxy.LivenessProbe, "/health"}} {
				switch {
				case pr.probe == nil || pr.probe.HTTPGet == nil:
					t.Errorf("%s: want an httpGet on %s", pr.kind, pr.path)
				case pr.probe.HTTPGet.Path != pr.path:
					t.Errorf("%s: path %s, want %s", pr.kind, pr.probe.HTTPGet.Path, pr.path)
				case containerPort(p.proxy, pr.probe.HTTPGet.Port) == 0:
					t.Errorf("%s: port %s is none of the container's", pr.kind, pr.probe.HTTPGet.Port.String())
				}
			}

			// Stopping: preStop sleeps while the pod leaves the endpoints, then SIGTERM starts
			// the drain of shutdown_timeout, then the proxy's own bounded waits.
			if cfg.ShutdownTimeout <= 0 {
				t.Fatal("the config sets no shutdown_timeout: set it, so the grace period can be checked against it")
			}
			preStop := sleepOf(p.proxy)
			if preStop <= 0 {
				t.Errorf("pdproxy has no preStop sleep: it would close its listener while kube-proxy still sends it new connections")
			}
			grace := 30 * time.Second // Kubernetes' default
			if g := p.dep.Spec.Template.Spec.TerminationGracePeriodSeconds; g != nil {
				grace = time.Duration(*g) * time.Second
			}
			need := preStop + cfg.ShutdownTimeout + afterDrain
			if grace < need {
				t.Errorf("terminationGracePeriodSeconds %s < preStop %s + shutdown_timeout %s + %s after the drain: the kubelet would kill the proxy mid-drain",
					grace, preStop, cfg.ShutdownTimeout, afterDrain)
			}
			// The sidecar: the engine must outlive the proxy's drain, which sends it the
			// streams' last tokens and the KV releases.
			for _, c := range p.others {
				s := sleepOf(c)
				if s < need {
					t.Errorf("container %s stops after a preStop sleep of %s, before pdproxy's drain can end (%s)", c.Name, s, need)
				}
				if grace <= s {
					t.Errorf("terminationGracePeriodSeconds %s leaves container %s no time to stop after its preStop sleep of %s", grace, c.Name, s)
				}
			}
		})
	}
}

// sleepOf is a container's preStop sleep, 0 without one.
func sleepOf(c *corev1.Container) time.Duration {
	if c.Lifecycle == nil || c.Lifecycle.PreStop == nil || c.Lifecycle.PreStop.Sleep == nil {
		return 0
	}
	return time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
}

// TestProxyRunsAsTheImagesNonRootUserOnAReadOnlyRoot: the pod runs pdproxy as the image's
// own numeric user, on a read-only root filesystem, with no privilege to gain.
func TestProxyRunsAsTheImagesNonRootUserOnAReadOnlyRoot(t *testing.T) {
	uid := imageUID(t, readImageRecipe(t).user)
	ms := loadManifests(t)
	for _, p := range proxyPods(t, ms) {
		t.Run(p.file, func(t *testing.T) {
			pod := p.dep.Spec.Template.Spec.SecurityContext
			if pod == nil {
				pod = &corev1.PodSecurityContext{}
			}
			c := p.proxy.SecurityContext
			if c == nil {
				t.Fatal("pdproxy has no securityContext")
			}
			nonRoot := pick(c.RunAsNonRoot, pod.RunAsNonRoot)
			if nonRoot == nil || !*nonRoot {
				t.Error("runAsNonRoot is not true")
			}
			if u := pick(c.RunAsUser, pod.RunAsUser); u == nil || *u != uid {
				t.Errorf("runAsUser %v, want the image's USER %d", deref(u), uid)
			}
			if c.ReadOnlyRootFilesystem == nil || !*c.ReadOnlyRootFilesystem {
				t.Error("readOnlyRootFilesystem is not true")
			}
			if c.AllowPrivilegeEscalation == nil || *c.AllowPrivilegeEscalation {
				t.Error("allowPrivilegeEscalation is not false")
			}
			if c.Capabilities == nil || !slices.Contains(c.Capabilities.Drop, "ALL") {
				t.Error("capabilities do not drop ALL")
			}
			if sp := pick(c.SeccompProfile, pod.SeccompProfile); sp == nil || sp.Type != corev1.SeccompProfileTypeRuntimeDefault {
				t.Error("no RuntimeDefault seccomp profile")
			}
			if _, ok := p.proxy.Resources.Requests[corev1.ResourceCPU]; !ok {
				t.Error("no CPU request: an HPA on CPU utilization cannot scale it, and the scheduler cannot place it")
			}
		})
	}
}

// pick is the container's setting if it has one, else the pod's.
func pick[T any](container, pod *T) *T {
	if container != nil {
		return container
	}
	return pod
}

func deref[T any](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}

// TestServicesBudgetAndAutoscalerReachTheirPods: each Service names the pods of a Deployment
// beside it (the proxy's, or Redis's) on ports they have; the PodDisruptionBudget and the
// HorizontalPodAutoscaler name the proxy's; so that none of them quietly applies to nothing.
func TestServicesBudgetAndAutoscalerReachTheirPods(t *testing.T) {
	ms := loadManifests(t)
	pods := proxyPods(t, ms)
	deps, depFiles := all[appsv1.Deployment](ms)
	for i, d := range deps {
		if d.Spec.Selector == nil || !matches(d.Spec.Selector.MatchLabels, d.Spec.Template.Labels) {
			t.Errorf("%s: Deployment %s's selector does not match its pods' labels %v", depFiles[i], d.Name, d.Spec.Template.Labels)
		}
	}
	// podsOf is the pdproxy pods that sel selects among the Deployments of dir (the objects
	// applied together with kubectl apply -f dir).
	podsOf := func(dir string, sel map[string]string) []proxyPod {
		var out []proxyPod
		for _, p := range pods {
			if filepath.Dir(p.file) == dir && len(sel) > 0 && matches(sel, p.dep.Spec.Template.Labels) {
				out = append(out, p)
			}
		}
		return out
	}

	svcs, files := all[corev1.Service](ms)
	for i, s := range svcs {
		t.Run(files[i]+"/"+s.Name, func(t *testing.T) {
			targets := deploymentsOf(ms, filepath.Dir(files[i]), s.Spec.Selector)
			if len(targets) == 0 {
				t.Fatalf("Service %s selects %v: no Deployment's pods beside it", s.Name, s.Spec.Selector)
			}
			for _, port := range s.Spec.Ports {
				for _, d := range targets {
					if podPort(&d.Spec.Template.Spec, port.TargetPort) == 0 {
						t.Errorf("Service %s port %s: targetPort %s is none of Deployment %s's ports", s.Name, port.Name, port.TargetPort.String(), d.Name)
					}
				}
			}
		})
	}

	pdbs, files := all[policyv1.PodDisruptionBudget](ms)
	for i, b := range pdbs {
		t.Run(files[i]+"/"+b.Name, func(t *testing.T) {
			if b.Spec.Selector == nil || len(podsOf(filepath.Dir(files[i]), b.Spec.Selector.MatchLabels)) == 0 {
				t.Fatalf("PodDisruptionBudget %s selects no pdproxy pods", b.Name)
			}
			if b.Spec.MaxUnavailable == nil && b.Spec.MinAvailable == nil {
				t.Error("neither maxUnavailable nor minAvailable is set")
			}
		})
	}

	hpas, files := all[autoscalingv2.HorizontalPodAutoscaler](ms)
	for i, h := range hpas {
		t.Run(files[i]+"/"+h.Name, func(t *testing.T) {
			ref := h.Spec.ScaleTargetRef
			j := slices.IndexFunc(pods, func(p proxyPod) bool {
				return filepath.Dir(p.file) == filepath.Dir(files[i]) && p.dep.Name == ref.Name
			})
			if ref.Kind != "Deployment" || ref.APIVersion != "apps/v1" || j < 0 {
				t.Fatalf("scaleTargetRef %s %s %s is no pdproxy Deployment beside it", ref.APIVersion, ref.Kind, ref.Name)
			}
			p := pods[j]
			if h.Spec.MinReplicas == nil || *h.Spec.MinReplicas < 2 {
				t.Error("minReplicas below 2: one replica's restart or eviction would leave no proxy")
			}
			if p.dep.Spec.Replicas != nil && h.Spec.MinReplicas != nil && *p.dep.Spec.Replicas < *h.Spec.MinReplicas {
				t.Errorf("the Deployment starts with %d replicas, below the autoscaler's minimum %d", *p.dep.Spec.Replicas, *h.Spec.MinReplicas)
			}
			if h.Spec.MaxReplicas < deref32(h.Spec.MinReplicas) {
				t.Errorf("maxReplicas %d < minReplicas %d", h.Spec.MaxReplicas, deref32(h.Spec.MinReplicas))
			}
		})
	}
}

func deref32(p *int32) int32 {
	if p == nil {
		return 1
	}
	return *p
}

// deploymentsOf is the Deployments of dir (the objects applied together with kubectl apply
// -f dir) whose pods sel selects.
func deploymentsOf(ms manifests, dir string, sel map[string]string) []*appsv1.Deployment {
	var out []*appsv1.Deployment
	deps, files := all[appsv1.Deployment](ms)
	for i, d := range deps {
		if filepath.Dir(files[i]) == dir && len(sel) > 0 && matches(sel, d.Spec.Template.Labels) {
			out = append(out, d)
		}
	}
	return out
}

// podPort resolves a port (a number or a name) to the number of a port of one of the pod's
// containers, or 0 when none has it.
func podPort(spec *corev1.PodSpec, port intstr.IntOrString) int32 {
	for i := range spec.Containers {
		if n := containerPort(&spec.Containers[i], port); n != 0 {
			return n
		}
	}
	return 0
}

// matches reports whether every label of sel is in labels.
func matches(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// standalonePods are the proxy's Deployments with no engine beside it: the replicas behind
// the Service, as opposed to the sidecar variant's, which are as many as the decoders.
func standalonePods(t *testing.T, ms manifests) []proxyPod {
	t.Helper()
	var out []proxyPod
	for _, p := range proxyPods(t, ms) {
		if len(p.others) == 0 {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		t.Fatalf("no Deployment in %s/ runs pdproxy on its own", manifestDir)
	}
	return out
}

// replicas is the number of replicas the proxy runs with: enough that one drained and one
// failing still leave one serving.
const replicas = 3

// TestProxyRunsThreeReplicasOnDifferentNodes: the standalone proxy starts 3 replicas and
// prefers to put them on different nodes, so that a node lost takes one; its budget lets one
// at most be down in a disruption, and its autoscaler never scales below the 3.
func TestProxyRunsThreeReplicasOnDifferentNodes(t *testing.T) {
	ms := loadManifests(t)
	for _, p := range standalonePods(t, ms) {
		t.Run(p.file, func(t *testing.T) {
			dir, labels := filepath.Dir(p.file), p.dep.Spec.Template.Labels
			if r := p.dep.Spec.Replicas; r == nil || *r != replicas {
				t.Errorf("replicas %v, want %d", deref(r), replicas)
			}

			aff := p.dep.Spec.Template.Spec.Affinity
			if aff == nil || aff.PodAntiAffinity == nil {
				t.Fatal("no podAntiAffinity: the scheduler may put every replica on one node")
			}
			if len(aff.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) > 0 {
				t.Error("a required podAntiAffinity leaves replicas pending on a cluster with fewer nodes than replicas; prefer it")
			}
			spread := slices.ContainsFunc(aff.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution, func(w corev1.WeightedPodAffinityTerm) bool {
				sel := w.PodAffinityTerm.LabelSelector
				return w.Weight > 0 && w.PodAffinityTerm.TopologyKey == corev1.LabelHostname &&
					sel != nil && len(sel.MatchExpressions) == 0 && len(sel.MatchLabels) > 0 && matches(sel.MatchLabels, labels)
			})
			if !spread {
				t.Errorf("no preferred podAntiAffinity on %s selecting the proxy's own pods %v", corev1.LabelHostname, labels)
			}

			pdbs, files := all[policyv1.PodDisruptionBudget](ms)
			var budgets []*policyv1.PodDisruptionBudget
			for i, b := range pdbs {
				if filepath.Dir(files[i]) == dir && b.Spec.Selector != nil && len(b.Spec.Selector.MatchLabels) > 0 &&
					len(b.Spec.Selector.MatchExpressions) == 0 && matches(b.Spec.Selector.MatchLabels, labels) {
					budgets = append(budgets, b)
				}
			}
			if len(budgets) != 1 {
				t.Fatalf("%d PodDisruptionBudgets select the proxy's pods, want 1", len(budgets))
			}
			if b := budgets[0]; b.Spec.MinAvailable != nil || b.Spec.MaxUnavailable == nil || *b.Spec.MaxUnavailable != intstr.FromInt32(1) {
				t.Errorf("PodDisruptionBudget %s: maxUnavailable %v, minAvailable %v; want maxUnavailable 1 alone, one replica down at a time whatever the count",
					b.Name, b.Spec.MaxUnavailable, b.Spec.MinAvailable)
			}

			hpas, files := all[autoscalingv2.HorizontalPodAutoscaler](ms)
			for i, h := range hpas {
				if filepath.Dir(files[i]) != dir || h.Spec.ScaleTargetRef.Name != p.dep.Name {
					continue
				}
				if h.Spec.MinReplicas == nil || *h.Spec.MinReplicas != replicas {
					t.Errorf("HorizontalPodAutoscaler %s: minReplicas %v; want %d, the Deployment's, or it scales the replicas in below them",
						h.Name, deref(h.Spec.MinReplicas), replicas)
				}
			}
		})
	}
}

// redisFile is the optional Redis of shared_state.
const redisFile = manifestDir + "/redis.yaml"

// redisManifest is redis.yaml's Deployment, its Redis container, and its Service.
func redisManifest(t *testing.T, ms manifests) (*appsv1.Deployment, *corev1.Container, *corev1.Service) {
	t.Helper()
	var (
		dep *appsv1.Deployment
		svc *corev1.Service
	)
	for _, o := range ms.files[redisFile] {
		switch v := o.(type) {
		case *appsv1.Deployment:
			dep = v
		case *corev1.Service:
			svc = v
		}
	}
	if dep == nil || svc == nil {
		t.Fatalf("%s: want a Deployment and a Service", redisFile)
	}
	cs := dep.Spec.Template.Spec.Containers
	if len(cs) != 1 {
		t.Fatalf("%s: Deployment %s has %d containers, want Redis alone", redisFile, dep.Name, len(cs))
	}
	return dep, &cs[0], svc
}

// argValue is the value after flag in args (the last, as redis-server reads them), "" and
// false when flag is not there.
func argValue(args []string, flag string) (string, bool) {
	v, ok := "", false
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag {
			v, ok = args[i+1], true
		}
	}
	return v, ok
}

// TestSharedStateNamesTheRedisService: the standalone config's shared_state.redis.addr is
// redis.yaml's Service, on a port of it that reaches the port Redis listens on.
func TestSharedStateNamesTheRedisService(t *testing.T) {
	ms := loadManifests(t)
	dep, redis, svc := redisManifest(t, ms)
	for _, p := range standalonePods(t, ms) {
		t.Run(p.file, func(t *testing.T) {
			cfg, err := app.ParseConfig([]byte(proxyConfigData(t, &p)))
			if err != nil {
				t.Fatal(err)
			}
			addr := cfg.SharedState.Redis.Addr
			if addr == "" {
				t.Fatal("the config sets no shared_state.redis.addr: the replicas would each keep their limits and sessions alone")
			}
			if len(cfg.Proxy.SessionAffinity.Headers) == 0 {
				t.Error("the config sets no session_affinity.headers: the replicas would share no session")
			}
			host, port, err := net.SplitHostPort(addr)
			if err != nil {
				t.Fatalf("shared_state.redis.addr %q: %v", addr, err)
			}
			// The Service's name, alone (the proxy's namespace) or qualified by a namespace.
			if name, _, _ := strings.Cut(host, "."); name != svc.Name {
				t.Errorf("shared_state.redis.addr %q: host %s is not %s's Service %s", addr, host, redisFile, svc.Name)
			}
			i := slices.IndexFunc(svc.Spec.Ports, func(sp corev1.ServicePort) bool { return strconv.Itoa(int(sp.Port)) == port })
			if i < 0 {
				t.Fatalf("shared_state.redis.addr %q: Service %s has no port %s", addr, svc.Name, port)
			}
			if !matches(svc.Spec.Selector, dep.Spec.Template.Labels) || len(svc.Spec.Selector) == 0 {
				t.Errorf("Service %s selects %v, not Deployment %s's pods", svc.Name, svc.Spec.Selector, dep.Name)
			}
			target := containerPort(redis, svc.Spec.Ports[i].TargetPort)
			if target == 0 {
				t.Fatalf("Service %s port %s: targetPort %s is none of the Redis container's", svc.Name, port, svc.Spec.Ports[i].TargetPort.String())
			}
			if v, _ := argValue(redis.Args, "--port"); v != strconv.Itoa(int(target)) {
				t.Errorf("Redis listens on --port %q, but its container's port is %d", v, target)
			}
		})
	}
}

// TestRedisRunsNonRootOnAReadOnlyRootAdmittingOnlyTheProxies: Redis runs as a numeric
// non-root user on a read-only root filesystem with no privilege to gain, within its
// resources, probed; and its NetworkPolicy admits the proxy's pods alone on its port.
func TestRedisRunsNonRootOnAReadOnlyRootAdmittingOnlyTheProxies(t *testing.T) {
	ms := loadManifests(t)
	dep, redis, _ := redisManifest(t, ms)
	spec := &dep.Spec.Template.Spec
	if r := dep.Spec.Replicas; r == nil || *r != 1 {
		t.Errorf("replicas %v, want 1: the replicas share one server", deref(r))
	}
	pod := spec.SecurityContext
	if pod == nil {
		pod = &corev1.PodSecurityContext{}
	}
	c := redis.SecurityContext
	if c == nil {
		t.Fatal("Redis has no securityContext")
	}
	if nonRoot := pick(c.RunAsNonRoot, pod.RunAsNonRoot); nonRoot == nil || !*nonRoot {
		t.Error("runAsNonRoot is not true")
	}
	// The kubelet checks runAsNonRoot against a numeric user only: the image's is a name.
	if u := pick(c.RunAsUser, pod.RunAsUser); u == nil || *u == 0 {
		t.Errorf("runAsUser %v, want the image's non-root user by number", deref(u))
	}
	if c.ReadOnlyRootFilesystem == nil || !*c.ReadOnlyRootFilesystem {
		t.Error("readOnlyRootFilesystem is not true")
	}
	if c.AllowPrivilegeEscalation == nil || *c.AllowPrivilegeEscalation {
		t.Error("allowPrivilegeEscalation is not false")
	}
	if c.Capabilities == nil || !slices.Contains(c.Capabilities.Drop, "ALL") {
		t.Error("capabilities do not drop ALL")
	}
	if sp := pick(c.SeccompProfile, pod.SeccompProfile); sp == nil || sp.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Error("no RuntimeDefault seccomp profile")
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("automountServiceAccountToken is not false: Redis never talks to the Kubernetes API")
	}
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if _, ok := redis.Resources.Requests[r]; !ok {
			t.Errorf("no %s request", r)
		}
		if _, ok := redis.Resources.Limits[r]; !ok {
			t.Errorf("no %s limit", r)
		}
	}
	for kind, pr := range map[string]*corev1.Probe{"readinessProbe": redis.ReadinessProbe, "livenessProbe": redis.LivenessProbe} {
		if pr == nil || (pr.Exec == nil && pr.TCPSocket == nil) {
			t.Errorf("%s: want an exec (redis-cli ping) or a tcpSocket", kind)
		}
	}

	// The policy: every rule admits the proxy's pods (by a podSelector of this namespace,
	// nothing wider) on Redis's port, and one rule at least exists.
	proxies := standalonePods(t, ms)
	var policies int
	for _, o := range ms.files[redisFile] {
		np, ok := o.(*networkingv1.NetworkPolicy)
		if !ok {
			continue
		}
		sel := np.Spec.PodSelector
		if len(sel.MatchLabels) == 0 || len(sel.MatchExpressions) > 0 || !matches(sel.MatchLabels, dep.Spec.Template.Labels) {
			t.Errorf("NetworkPolicy %s selects %v, not Redis's pods alone", np.Name, sel.MatchLabels)
			continue
		}
		policies++
		if !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) || len(np.Spec.Ingress) == 0 {
			t.Errorf("NetworkPolicy %s admits no ingress by rule", np.Name)
		}
		for i, rule := range np.Spec.Ingress {
			if len(rule.From) == 0 {
				t.Errorf("NetworkPolicy %s, ingress %d: no from, which admits every client", np.Name, i)
			}
			for _, peer := range rule.From {
				ps := peer.PodSelector
				if peer.NamespaceSelector != nil || peer.IPBlock != nil || ps == nil || len(ps.MatchLabels) == 0 || len(ps.MatchExpressions) > 0 ||
					!slices.ContainsFunc(proxies, func(p proxyPod) bool { return matches(ps.MatchLabels, p.dep.Spec.Template.Labels) }) {
					t.Errorf("NetworkPolicy %s, ingress %d: a peer other than the proxy's pods", np.Name, i)
				}
			}
			if len(rule.Ports) == 0 {
				t.Errorf("NetworkPolicy %s, ingress %d: every port", np.Name, i)
			}
			for _, port := range rule.Ports {
				if port.Port == nil || containerPort(redis, *port.Port) == 0 {
					t.Errorf("NetworkPolicy %s, ingress %d: port %v is none of Redis's", np.Name, i, port.Port)
				}
			}
		}
	}
	if policies == 0 {
		t.Errorf("%s has no NetworkPolicy for Redis: every pod of the cluster could reach it, with no password", redisFile)
	}
}

// TestRedisContainerStartsARedisThatKeepsNothingAndEvicts starts Debian's redis-server with
// the Redis container's own command and args (only the port moved, to a free one, and bound
// to loopback) and asks it for its settings: nothing written to disk, a memory bound below
// the container's limit with a policy that evicts, clients admitted from other pods. Then
// its probes' commands, run against it, pass, and fail once it is gone.
func TestRedisContainerStartsARedisThatKeepsNothingAndEvicts(t *testing.T) {
	ms := loadManifests(t)
	_, redis, _ := redisManifest(t, ms)
	args := append(slices.Clone(redis.Command), redis.Args...)
	if len(args) == 0 || filepath.Base(args[0]) != "redis-server" {
		t.Fatalf("the container runs %v, not redis-server", args)
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redis-server is not on PATH (apt-get install -y redis-server; .ci/run installs it): %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	ln.Close()
	// redis-server takes the last of a flag given twice.
	cmd := exec.Command(bin, append(slices.Clone(args[1:]), "--port", port, "--bind", "127.0.0.1", "--dir", t.TempDir())...)
	// A file, not a buffer: the test reads it while the server writes.
	logPath := filepath.Join(t.TempDir(), "redis.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	logOf := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cmd.Process.Kill()
			cmd.Wait()
		}
	}
	defer stop()

	// probe runs a probe's command against the server: its port swapped for this one's.
	probe := func(kind string, pr *corev1.Probe) error {
		t.Helper()
		if pr == nil || pr.Exec == nil {
			return nil // a tcpSocket probe: it needs nothing of the image
		}
		c := slices.Clone(pr.Exec.Command)
		i := slices.Index(c, "-p")
		if i < 0 || i+1 >= len(c) {
			t.Fatalf("%s %v: no -p PORT", kind, c)
		}
		if want, _ := argValue(args, "--port"); c[i+1] != want {
			t.Errorf("%s %v asks port %s, Redis listens on %s", kind, c, c[i+1], want)
		}
		c[i+1] = port
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		b, err := exec.CommandContext(ctx, c[0], c[1:]...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s %v: %w: %s", kind, c, err, b)
		}
		return nil
	}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		err := probe("readinessProbe", redis.ReadinessProbe)
		return err == nil, fmt.Sprintf("redis-server %v is not ready: %v\n%s", args[1:], err, logOf())
	})
	if err := probe("livenessProbe", redis.LivenessProbe); err != nil {
		t.Error(err)
	}

	config := func(name string) string {
		t.Helper()
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+port, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n$%d\r\n%s\r\n", len(name), name)
		// The reply: *2, then the name and the value as bulk strings.
		r := bufio.NewReader(c)
		var lines []string
		for range 5 {
			l, err := r.ReadString('\n')
			if err != nil {
				t.Fatalf("CONFIG GET %s: %v (read %q)", name, err, lines)
			}
			lines = append(lines, strings.TrimRight(l, "\r\n"))
		}
		if lines[0] != "*2" || lines[2] != name {
			t.Fatalf("CONFIG GET %s: %q", name, lines)
		}
		return lines[4]
	}
	if v := config("save"); v != "" {
		t.Errorf("save %q: Redis writes snapshots; its state is soft, and the root filesystem is read-only", v)
	}
	if v := config("appendonly"); v != "no" {
		t.Errorf("appendonly %q: Redis writes an append-only file", v)
	}
	if v := config("protected-mode"); v != "no" {
		t.Errorf("protected-mode %q: with no password, Redis refuses every client but loopback, so no proxy pod", v)
	}
	if v := config("maxmemory-policy"); v == "noeviction" {
		t.Errorf("maxmemory-policy %s: a full Redis would refuse the writes (every key has a TTL: any may go)", v)
	}
	limit, ok := redis.Resources.Limits[corev1.ResourceMemory]
	maxmem, err := strconv.ParseInt(config("maxmemory"), 10, 64)
	switch {
	case err != nil:
		t.Fatal(err)
	case !ok:
		t.Error("no memory limit")
	case maxmem <= 0 || maxmem > limit.Value()*3/4:
		t.Errorf("maxmemory %d bytes: want a bound within 3/4 of the container's memory limit %s, or Redis is killed before it evicts", maxmem, limit.String())
	}

	stop()
	if err := probe("livenessProbe", redis.LivenessProbe); err == nil && redis.LivenessProbe.Exec != nil {
		t.Error("the liveness probe passes with Redis gone")
	}
}
