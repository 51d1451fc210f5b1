package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/deploy/internal/deploytest"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// strictDecoder decodes Kubernetes manifests into the API's Go types (k8s.io/api) with
// apimachinery's strict YAML/JSON serializer: an unknown field, a repeated field, a value of the
// wrong type, an unknown apiVersion or kind is an error naming it. This is the decoding the API
// server does under strict field validation (kubectl apply --validate=strict).
func strictDecoder() runtime.Decoder {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme} {
		if err := add(scheme); err != nil {
			panic(err)
		}
	}
	return serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()
}

// decodeManifests decodes every YAML document of text strictly; name labels the errors.
func decodeManifests(name string, text []byte) ([]runtime.Object, error) {
	dec := strictDecoder()
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(text)))
	var objs []runtime.Object
	var errs []error
	for i := 0; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 || isOnlyComments(doc) {
			continue
		}
		obj, _, err := dec.Decode(doc, nil, nil)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s, document %d: %w", name, i+1, err))
			continue
		}
		objs = append(objs, obj)
	}
	return objs, errors.Join(errs...)
}

func isOnlyComments(doc []byte) bool {
	for _, l := range strings.Split(string(doc), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

// manifests are the decoded objects of deploy/kubernetes.
type manifests struct {
	configMap *corev1.ConfigMap
	sts       *appsv1.StatefulSet
	svc       *corev1.Service
	files     map[string][]byte
}

// readManifestDir decodes strictly every file of dir, not of its subdirectories (kubectl apply -f
// DIR reads only the directory's own files unless given -R), and returns the objects and the
// files' texts by base name.
func readManifestDir(t *testing.T, dir string) ([]runtime.Object, map[string][]byte) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{}
	var objs []runtime.Object
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		// kubectl apply -f DIR reads .yaml, .yml and .json; anything else there is a mistake.
		if ext := filepath.Ext(e.Name()); ext != ".yaml" {
			t.Errorf("%s: %s holds only .yaml manifests (kubectl apply -f %s/)", e.Name(), dir, dir)
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		files[e.Name()] = b
		o, err := decodeManifests(e.Name(), b)
		if err != nil {
			t.Fatal(err)
		}
		objs = append(objs, o...)
	}
	return objs, files
}

func loadManifests(t *testing.T) manifests {
	t.Helper()
	objs, files := readManifestDir(t, filepath.Join(tooltest.RepoRoot(t), "deploy", "kubernetes"))
	m := manifests{files: files}
	for _, o := range objs {
		switch o := o.(type) {
		case *corev1.ConfigMap:
			m.configMap = o
		case *appsv1.StatefulSet:
			m.sts = o
		case *corev1.Service:
			m.svc = o
		default:
			t.Errorf("deploy/kubernetes: unexpected %T", o)
		}
	}
	if m.configMap == nil || m.sts == nil || m.svc == nil {
		t.Fatalf("deploy/kubernetes must hold a ConfigMap, a StatefulSet and a Service; got %+v", m)
	}
	return m
}

// TestKubernetesManifestsDecodeStrictly: every manifest decodes strictly into the API's types.
func TestKubernetesManifestsDecodeStrictly(t *testing.T) {
	m := loadManifests(t)
	if len(m.files) != 3 {
		t.Errorf("files %v", slices.Sorted(func(yield func(string) bool) {
			for k := range m.files {
				if !yield(k) {
					return
				}
			}
		}))
	}
}

// TestStrictDecoderRejectsMistakes proves the validation can fail: each mistake in a real
// manifest is reported, naming the field.
func TestStrictDecoderRejectsMistakes(t *testing.T) {
	cases := []struct {
		name, file, old, new, want string
	}{
		{"typo in a probe", "statefulset.yaml", "          readinessProbe:", "          readinesProbe:", `unknown field "spec.template.spec.initContainers[0].readinesProbe"`},
		{"typo deep in a port", "statefulset.yaml", "              containerPort: 8000", "              containerport: 8000", `unknown field "spec.template.spec.containers[0].ports[0].containerport"`},
		{"typo in a volume", "statefulset.yaml", "          emptyDir:", "          emptydir:", `unknown field "spec.template.spec.volumes[0].emptydir"`},
		{"wrong type", "statefulset.yaml", "  replicas: 1", "  replicas: one", "replicas"},
		{"repeated field", "statefulset.yaml", "  replicas: 1\n", "  replicas: 1\n  replicas: 2\n", `key "replicas" already set`},
		{"unknown kind", "statefulset.yaml", "kind: StatefulSet", "kind: StatefullSet", `no kind "StatefullSet" is registered`},
		{"unknown version", "statefulset.yaml", "apiVersion: apps/v1", "apiVersion: apps/v1beta9", "apps/v1beta9"},
		{"typo in the spread", "replicas/deployment.yaml", "          topologyKey:", "          topologykey:", `unknown field "spec.template.spec.topologySpreadConstraints[0].topologykey"`},
		{"typo in the strategy", "replicas/deployment.yaml", "      maxSurge: 1", "      maxsurge: 1", `unknown field "spec.strategy.rollingUpdate.maxsurge"`},
		{"typo in the budget", "replicas/poddisruptionbudget.yaml", "  minAvailable:", "  minAvailble:", `unknown field "spec.minAvailble"`},
		{"unknown budget version", "replicas/poddisruptionbudget.yaml", "apiVersion: policy/v1", "apiVersion: policy/v1beta9", "policy/v1beta9"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			orig, err := os.ReadFile(filepath.Join(tooltest.RepoRoot(t), "deploy", "kubernetes", tc.file))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := decodeManifests(tc.file, orig); err != nil {
				t.Fatal(err)
			}
			if !bytes.Contains(orig, []byte(tc.old)) {
				t.Fatalf("%s no longer contains %q: update the test", tc.file, tc.old)
			}
			bad := bytes.Replace(orig, []byte(tc.old), []byte(tc.new), 1)
			_, err = decodeManifests(tc.file, bad)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// container returns the pod's container or init container called name.
func container(t *testing.T, spec *corev1.PodSpec, name string) *corev1.Container {
	t.Helper()
	for _, list := range [][]corev1.Container{spec.InitContainers, spec.Containers} {
		for i := range list {
			if list[i].Name == name {
				return &list[i]
			}
		}
	}
	t.Fatalf("no container %q", name)
	return nil
}

func mountOf(c *corev1.Container, volume string) *corev1.VolumeMount {
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].Name == volume {
			return &c.VolumeMounts[i]
		}
	}
	return nil
}

func portOf(c *corev1.Container, name string) int32 {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	return 0
}

// cfguardConfigText is the ConfigMap's cfguard configuration and the path cfguard reads it at.
func cfguardConfigText(t *testing.T, spec *corev1.PodSpec, cm *corev1.ConfigMap) (string, string) {
	t.Helper()
	c := container(t, spec, "cfguard")
	i := slices.Index(c.Args, "--config")
	if i < 0 || i+1 >= len(c.Args) {
		t.Fatalf("cfguard args %v: no --config", c.Args)
	}
	p := c.Args[i+1]
	text, ok := cm.Data[path.Base(p)]
	if !ok {
		t.Fatalf("ConfigMap %s has no key %s (cfguard reads %s)", cm.Name, path.Base(p), p)
	}
	return text, p
}

// checkSelects reports an error unless selector (a workload's, a Service's, a budget's)
// selects a pod with labels.
func checkSelects(t *testing.T, what string, selector, labels map[string]string) {
	t.Helper()
	if len(selector) == 0 {
		t.Errorf("%s has an empty selector", what)
	}
	for k, v := range selector {
		if labels[k] != v {
			t.Errorf("%s selector %s=%s does not match the pod template's labels %v", what, k, v, labels)
		}
	}
}

// checkServicePorts reports a Service port whose target no container of spec declares.
func checkServicePorts(t *testing.T, svc *corev1.Service, spec *corev1.PodSpec) {
	t.Helper()
	for _, sp := range svc.Spec.Ports {
		found := false
		for _, list := range [][]corev1.Container{spec.InitContainers, spec.Containers} {
			for i := range list {
				if portOf(&list[i], sp.TargetPort.String()) != 0 {
					found = true
				}
			}
		}
		if !found {
			t.Errorf("Service %s port %s targets %s, which no container declares", svc.Name, sp.Name, sp.TargetPort.String())
		}
	}
}

// checkPodTemplate checks a pod of the model server and the cfguard sidecar against the image,
// the daemon's configuration in cm and the Secret: the sidecar, its command line and user, the
// configuration's mount, the export, ports, probes, the scrape annotations, the grace period and
// the tokens. Where state_dir lives differs between the workloads; their tests check it. It
// returns the configuration and the port of http.listen.
func checkPodTemplate(t *testing.T, tmpl *corev1.PodTemplateSpec, cm *corev1.ConfigMap) (*config.Config, string) {
	t.Helper()
	spec := &tmpl.Spec
	cf := container(t, spec, "cfguard")
	ms := container(t, spec, "model-server")
	if cf.RestartPolicy == nil || *cf.RestartPolicy != corev1.ContainerRestartPolicyAlways || !slices.ContainsFunc(spec.InitContainers, func(c corev1.Container) bool { return c.Name == "cfguard" }) {
		t.Error("cfguard must be a native sidecar: an init container with restartPolicy: Always")
	}

	// The default image's command line and user.
	def := defaultTarget(readDockerfile(t))
	cmd, user := def.last(t, "CMD").args, def.last(t, "USER").args[0]
	if !slices.Equal(cf.Args, cmd) {
		t.Errorf("cfguard args %q, the image's CMD is %q", cf.Args, cmd)
	}
	uid, _, _ := strings.Cut(user, ":")
	sc := spec.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || strconv.FormatInt(*sc.RunAsUser, 10) != uid || sc.FSGroup == nil {
		t.Errorf("pod securityContext must run as non-root uid %s with an fsGroup (the state volume)", uid)
	}
	for _, c := range []*corev1.Container{cf, ms} {
		if c.SecurityContext == nil || c.SecurityContext.ReadOnlyRootFilesystem == nil || !*c.SecurityContext.ReadOnlyRootFilesystem {
			t.Errorf("container %s: readOnlyRootFilesystem should be true (cfguard writes only under state_dir and the export)", c.Name)
		}
	}

	// The configuration and where it is mounted.
	text, cfgPath := cfguardConfigText(t, spec, cm)
	cfg, err := config.Load(text)
	if err != nil {
		t.Fatalf("the ConfigMap %s's config.yaml: %v", cm.Name, err)
	}
	cmount := mountOf(cf, "config")
	if cmount == nil || cmount.MountPath != path.Dir(cfgPath) {
		t.Fatalf("cfguard reads %s but the config volume is mounted at %+v", cfgPath, cmount)
	}
	vols := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		vols[v.Name] = v
	}
	if v := vols[cmount.Name]; v.ConfigMap == nil || v.ConfigMap.Name != cm.Name {
		t.Errorf("volume %s is not the ConfigMap %s", cmount.Name, cm.Name)
	}
	// The export on the shared emptyDir.
	em := mountOf(cf, "export")
	if em == nil || em.MountPath != cfg.ExportDir() || em.ReadOnly {
		t.Errorf("model.export_dir %s, but cfguard mounts export at %+v", cfg.ExportDir(), em)
	}
	if v := vols["export"]; v.EmptyDir == nil {
		t.Error("volume export should be an emptyDir shared by the two containers")
	}
	if mm := mountOf(ms, "export"); mm == nil || !mm.ReadOnly {
		t.Error("the model server must mount export read-only")
	}
	// Ports: http.listen, the container port, the probes, the scrape annotation.
	host, listenPort, err := net.SplitHostPort(cfg.HTTP.Listen)
	if err != nil {
		t.Fatal(err)
	}
	if p := portOf(cf, "cfguard-http"); strconv.Itoa(int(p)) != listenPort {
		t.Errorf("containerPort cfguard-http %d, http.listen %s", p, cfg.HTTP.Listen)
	}
	if host == "127.0.0.1" || host == "localhost" {
		t.Errorf("http.listen %s: the kubelet's probes and the Service cannot reach loopback", cfg.HTTP.Listen)
	}
	ann := tmpl.Annotations
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != listenPort || ann["prometheus.io/path"] != "/metrics" {
		t.Errorf("scrape annotations %v, want scrape true, port %s, path /metrics", ann, listenPort)
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"startup", cf.StartupProbe, "/readyz"}, {"liveness", cf.LivenessProbe, "/healthz"}, {"readiness", cf.ReadinessProbe, "/readyz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port.String() != "cfguard-http" {
			t.Errorf("%s probe %+v, want GET %s on port cfguard-http", p.name, p.probe, p.path)
		}
		// docs/DEPLOY.md: a probe's answer can take seconds on a starved core; Kubernetes'
		// default timeout is 1 s.
		if p.probe != nil && p.probe.TimeoutSeconds != 3 {
			t.Errorf("%s probe timeoutSeconds %d, want 3", p.name, p.probe.TimeoutSeconds)
		}
	}
	if g := spec.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second < cfg.HTTP.ShutdownTimeout+5*time.Second {
		t.Errorf("terminationGracePeriodSeconds %v is shorter than http.shutdown_timeout %v + the consumer's 5 s group leave", g, cfg.HTTP.ShutdownTimeout)
	}
	// The tokens come from the Secret docs/DEPLOY.md tells you to create.
	secretKeys := map[string]string{}
	for _, c := range []*corev1.Container{cf, ms} {
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
				secretKeys[c.Name+"/"+e.Name] = e.ValueFrom.SecretKeyRef.Name + "/" + e.ValueFrom.SecretKeyRef.Key
			}
		}
	}
	for env, want := range map[string]string{"cfguard/CFGUARD_HTTP_TOKEN": "cfguard/http-token", "cfguard/CFGUARD_HTTP_METRICS_TOKEN": "cfguard/metrics-token",
		"model-server/CFGUARD_HTTP_TOKEN": "cfguard/http-token"} {
		if secretKeys[env] != want {
			t.Errorf("%s from secret %q, want %q", env, secretKeys[env], want)
		}
	}
	return cfg, listenPort
}

// TestKubernetesManifestsAgree checks the manifests against each other, the image and the
// daemon's configuration: ports, mounts, probes, the Secret's keys, the user.
func TestKubernetesManifestsAgree(t *testing.T) {
	m := loadManifests(t)
	spec := &m.sts.Spec.Template.Spec
	if m.sts.Spec.Replicas == nil || *m.sts.Spec.Replicas != 1 {
		t.Error("the StatefulSet must have exactly 1 replica (one writer of the ledger)")
	}
	checkSelects(t, "StatefulSet", m.sts.Spec.Selector.MatchLabels, m.sts.Spec.Template.Labels)
	checkSelects(t, "Service", m.svc.Spec.Selector, m.sts.Spec.Template.Labels)
	if m.sts.Spec.ServiceName != m.svc.Name {
		t.Errorf("serviceName %q, the Service is %q", m.sts.Spec.ServiceName, m.svc.Name)
	}
	cfg, _ := checkPodTemplate(t, &m.sts.Spec.Template, m.configMap)
	checkServicePorts(t, m.svc, spec)
	// state_dir on the claim template.
	if len(m.sts.Spec.VolumeClaimTemplates) != 1 {
		t.Fatal("want one volumeClaimTemplate (state_dir)")
	}
	claim := m.sts.Spec.VolumeClaimTemplates[0].Name
	if sm := mountOf(container(t, spec, "cfguard"), claim); sm == nil || sm.MountPath != cfg.StateDir {
		t.Errorf("state_dir %s, but the claim %q is mounted at %+v", cfg.StateDir, claim, sm)
	}
	guide, err := os.ReadFile(filepath.Join(tooltest.RepoRoot(t), "docs", "DEPLOY.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kubectl create secret generic cfguard", "--from-literal=http-token=", "--from-literal=metrics-token=", "kubectl apply -f deploy/kubernetes/"} {
		if !bytes.Contains(guide, []byte(want)) {
			t.Errorf("docs/DEPLOY.md does not show %q", want)
		}
	}
}

// TestKubernetesConfigRuns: the ConfigMap's configuration passes `cfguard check-config` (see
// cfguardBinary) and a daemon started on it (moved to loopback and a temporary
// state_dir, the token set as the Secret would) answers the probes' and the scrape's paths.
func TestKubernetesConfigRuns(t *testing.T) {
	m := loadManifests(t)
	text, _ := cfguardConfigText(t, &m.sts.Spec.Template.Spec, m.configMap)
	cfguard := cfguardBinary(t)
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(cfguard, "check-config", "--config", p).CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("is valid")) {
		t.Fatalf("cfguard check-config on the ConfigMap's config.yaml: %v\n%s", err, out)
	}
	// check-config can fail: a misspelt key in the same text.
	bad := adaptConfigText(t, []byte(text), map[string]any{"certify.dleta": 0.1})
	out, err = exec.Command(cfguard, "check-config", "--config", bad).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !bytes.Contains(out, []byte(`did you mean "delta"`)) {
		t.Fatalf("check-config on a misspelt key: %v\n%s", err, out)
	}

	cfg, err := config.Load(text)
	if err != nil {
		t.Fatal(err)
	}
	cfg.HTTP.Token = "from-the-secret"
	d := deploytest.StartDaemon(t, *cfg)
	base := "http://" + d.HTTPAddr()
	cf := container(t, &m.sts.Spec.Template.Spec, "cfguard")
	for _, pr := range []*corev1.Probe{cf.StartupProbe, cf.LivenessProbe, cf.ReadinessProbe} {
		if code, body, err := deploytest.HTTPGet(base+pr.HTTPGet.Path, ""); err != nil || code != 200 {
			t.Errorf("probe GET %s without a token: %d %s %v", pr.HTTPGet.Path, code, body, err)
		}
	}
	if code, body, err := deploytest.HTTPGet(base+m.sts.Spec.Template.Annotations["prometheus.io/path"], ""); err != nil || code != 200 || !bytes.Contains(body, []byte("cfguard_kl_budget")) {
		t.Errorf("scrape path: %d %v", code, err)
	}
	if code, _, _ := deploytest.HTTPGet(base+"/v1/model", ""); code != 401 {
		t.Errorf("GET /v1/model without the token: %d, want 401", code)
	}
	if code, _, _ := deploytest.HTTPGet(base+"/v1/model", "from-the-secret"); code != 200 {
		t.Errorf("GET /v1/model with the token: %d, want 200", code)
	}
}
