package deploy

import (
	"bytes"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/tooltest"
	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// replicaManifests are the decoded objects of deploy/kubernetes/replicas: N pods of the model
// server and a cfguard replica.
type replicaManifests struct {
	configMap *corev1.ConfigMap
	deploy    *appsv1.Deployment
	svc       *corev1.Service
	pdb       *policyv1.PodDisruptionBudget
	files     map[string][]byte
}

func loadReplicaManifests(t *testing.T) replicaManifests {
	t.Helper()
	objs, files := readManifestDir(t, filepath.Join(tooltest.RepoRoot(t), "deploy", "kubernetes", "replicas"))
	m := replicaManifests{files: files}
	seen := map[string]int{}
	for _, o := range objs {
		seen[fmt.Sprintf("%T", o)]++
		switch o := o.(type) {
		case *corev1.ConfigMap:
			m.configMap = o
		case *appsv1.Deployment:
			m.deploy = o
		case *corev1.Service:
			m.svc = o
		case *policyv1.PodDisruptionBudget:
			m.pdb = o
		default:
			t.Errorf("deploy/kubernetes/replicas: unexpected %T", o)
		}
	}
	for kind, n := range seen {
		if n > 1 {
			t.Errorf("deploy/kubernetes/replicas holds %d objects of type %s, want one", n, kind)
		}
	}
	if m.configMap == nil || m.deploy == nil || m.svc == nil || m.pdb == nil {
		t.Fatalf("deploy/kubernetes/replicas must hold a ConfigMap, a Deployment, a Service and a PodDisruptionBudget; got %+v", m)
	}
	return m
}

// TestKubernetesReplicaManifestsDecodeStrictly: every manifest of the replicas decodes strictly
// into the API's types (apps/v1, core/v1, policy/v1), one object of each kind.
func TestKubernetesReplicaManifestsDecodeStrictly(t *testing.T) {
	m := loadReplicaManifests(t)
	if len(m.files) != 4 {
		t.Errorf("files %v, want the four manifests", slices.Sorted(func(yield func(string) bool) {
			for k := range m.files {
				if !yield(k) {
					return
				}
			}
		}))
	}
}

// podEnv resolves a container's environment as the kubelet does for the variables it can know
// here: plain values with $(NAME) expanded from the variables defined before them (a reference
// to a later or unknown one stays as written, as Kubernetes leaves it), fields of the downward
// API from fields, secrets from secrets ("secret/key").
func podEnv(t *testing.T, c *corev1.Container, fields, secrets map[string]string) map[string]string {
	t.Helper()
	env := map[string]string{}
	ref := regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = ref.ReplaceAllStringFunc(e.Value, func(s string) string {
				if v, ok := env[s[2:len(s)-1]]; ok {
					return v
				}
				return s
			})
		case e.ValueFrom.FieldRef != nil:
			v, ok := fields[e.ValueFrom.FieldRef.FieldPath]
			if !ok {
				t.Fatalf("env %s from field %s, which the test does not know", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			env[e.Name] = v
		case e.ValueFrom.SecretKeyRef != nil:
			if v, ok := secrets[e.ValueFrom.SecretKeyRef.Name+"/"+e.ValueFrom.SecretKeyRef.Key]; ok {
				env[e.Name] = v
			}
		default:
			t.Fatalf("env %s: a source the test does not know", e.Name)
		}
	}
	return env
}

// replicaPodIP is the pod IP the tests give a replica's downward API.
const replicaPodIP = "10.1.2.3"

// TestKubernetesReplicaManifestsAgree checks the replicas' manifests against each other, the
// image, the daemon's configuration and the single-node manifests: the same pod checks as the
// StatefulSet's, then what replicas need (replication on, a real cluster, a per-pod advertised
// address, state on an emptyDir) and what keeps a majority serving (rollout, budget, spread).
func TestKubernetesReplicaManifestsAgree(t *testing.T) {
	m := loadReplicaManifests(t)
	tmpl := &m.deploy.Spec.Template
	spec := &tmpl.Spec
	checkSelects(t, "Deployment", m.deploy.Spec.Selector.MatchLabels, tmpl.Labels)
	checkSelects(t, "Service", m.svc.Spec.Selector, tmpl.Labels)
	checkSelects(t, "PodDisruptionBudget", m.pdb.Spec.Selector.MatchLabels, tmpl.Labels)
	if len(m.deploy.Spec.Selector.MatchExpressions) > 0 || len(m.pdb.Spec.Selector.MatchExpressions) > 0 {
		t.Error("selectors use matchLabels only (checked against the pod template here)")
	}
	cfg, listenPort := checkPodTemplate(t, tmpl, m.configMap)
	checkServicePorts(t, m.svc, spec)
	cf := container(t, spec, "cfguard")

	// The single node and the replicas can live in one namespace: no name is shared, and
	// neither set's selectors take the other's pods.
	single := loadManifests(t)
	if m.configMap.Name == single.configMap.Name || m.svc.Name == single.svc.Name || m.deploy.Name == single.sts.Name {
		t.Errorf("the replicas' objects (%s, %s, %s) reuse a name of the single node's", m.configMap.Name, m.svc.Name, m.deploy.Name)
	}
	for what, sel := range map[string]map[string]string{"the StatefulSet": single.sts.Spec.Selector.MatchLabels, "the single node's Service": single.svc.Spec.Selector} {
		if selects(sel, tmpl.Labels) {
			t.Errorf("%s's selector %v takes the replicas' pods %v", what, sel, tmpl.Labels)
		}
	}
	for what, sel := range map[string]map[string]string{"Deployment": m.deploy.Spec.Selector.MatchLabels, "Service": m.svc.Spec.Selector, "PodDisruptionBudget": m.pdb.Spec.Selector.MatchLabels} {
		if selects(sel, single.sts.Spec.Template.Labels) {
			t.Errorf("the replicas' %s selector %v takes the single node's pod %v", what, sel, single.sts.Spec.Template.Labels)
		}
	}

	// Replication on, against a real cluster, one config for every pod.
	r := cfg.Replication
	if !r.Enabled || cfg.Embedded() || len(cfg.Kafka.Brokers) == 0 {
		t.Errorf("replication.enabled %v, kafka.brokers %v: replicas share a Kafka cluster", r.Enabled, cfg.Kafka.Brokers)
	}
	if r.ReplicaID != "" {
		t.Errorf("replication.replica_id %q: one ConfigMap serves every pod, so it would name them all; leave the default (the pod's name)", r.ReplicaID)
	}
	if r.AdvertiseURL != "" {
		t.Errorf("replication.advertise_url %q in the ConfigMap: each pod has its own address (CFGUARD_REPLICATION_ADVERTISE_URL)", r.AdvertiseURL)
	}
	n := 0
	if m.deploy.Spec.Replicas != nil {
		n = int(*m.deploy.Spec.Replicas)
	}
	if n < 3 || n > r.CEPartitions {
		t.Errorf("replicas %d: want at least 3 (a majority survives one lost) and at most replication.ce_partitions %d (the most that share CEs)", n, r.CEPartitions)
	}

	// Each pod advertises its own IP on the port of http.listen: POD_IP from the downward API,
	// defined before the variable that refers to it.
	names := make([]string, len(cf.Env))
	for i, e := range cf.Env {
		names[i] = e.Name
	}
	ip, adv := slices.Index(names, "POD_IP"), slices.Index(names, "CFGUARD_REPLICATION_ADVERTISE_URL")
	if ip < 0 || cf.Env[ip].ValueFrom == nil || cf.Env[ip].ValueFrom.FieldRef == nil || cf.Env[ip].ValueFrom.FieldRef.FieldPath != "status.podIP" {
		t.Fatalf("cfguard env %v: want POD_IP from the field status.podIP", names)
	}
	if adv < ip {
		t.Fatalf("cfguard env %v: CFGUARD_REPLICATION_ADVERTISE_URL must follow POD_IP (Kubernetes expands $(POD_IP) only from variables defined before)", names)
	}
	env := podEnv(t, cf, map[string]string{"status.podIP": replicaPodIP}, nil)
	u, err := url.Parse(env["CFGUARD_REPLICATION_ADVERTISE_URL"])
	if err != nil || u.Scheme != "http" || u.Hostname() != replicaPodIP || u.Port() != listenPort || (u.Path != "" && u.Path != "/") {
		t.Errorf("CFGUARD_REPLICATION_ADVERTISE_URL resolves to %q (%v), want http://%s:%s (the pod's IP, http.listen's port)", env["CFGUARD_REPLICATION_ADVERTISE_URL"], err, replicaPodIP, listenPort)
	}
	if cfg.HTTP.WebConfigFile != "" {
		t.Error("http.web_config_file serves TLS: the advertised URL must then be https://")
	}

	// state_dir on an emptyDir: the ledger is a cache of the Kafka topics.
	vols := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		vols[v.Name] = v
	}
	sm := mountOf(cf, "state")
	if sm == nil || sm.MountPath != cfg.StateDir || sm.ReadOnly {
		t.Errorf("state_dir %s, but the volume state is mounted at %+v", cfg.StateDir, sm)
	}
	if v := vols["state"]; v.EmptyDir == nil || v.EmptyDir.Medium != corev1.StorageMediumDefault || v.EmptyDir.SizeLimit == nil {
		t.Errorf("volume state %+v: want an emptyDir on the node's disk with a sizeLimit", v.VolumeSource)
	}

	// A rollout replaces one pod at a time and keeps a majority serving.
	st := m.deploy.Spec.Strategy
	if st.Type != appsv1.RollingUpdateDeploymentStrategyType || st.RollingUpdate == nil ||
		st.RollingUpdate.MaxSurge == nil || *st.RollingUpdate.MaxSurge != intstr.FromInt32(1) ||
		st.RollingUpdate.MaxUnavailable == nil || *st.RollingUpdate.MaxUnavailable != intstr.FromInt32(1) {
		t.Errorf("strategy %+v: want RollingUpdate with maxSurge 1, maxUnavailable 1", st)
	} else if n-1 <= n/2 {
		t.Errorf("replicas %d with maxUnavailable 1 leave no majority during a rollout", n)
	}
	// Evictions keep a majority, at the manifest's count and at any count up to the most that
	// share CEs, and still let a drain evict one pod.
	if m.pdb.Spec.MinAvailable == nil || m.pdb.Spec.MaxUnavailable != nil {
		t.Fatalf("PodDisruptionBudget: want minAvailable (a majority), got %+v", m.pdb.Spec)
	}
	for k := 3; k <= max(n, r.CEPartitions); k++ {
		// The disruption controller rounds a percentage of minAvailable up.
		v, err := intstr.GetScaledValueFromIntOrPercent(m.pdb.Spec.MinAvailable, k, true)
		if err != nil || v <= k/2 || v >= k {
			t.Errorf("minAvailable %s of %d replicas is %d (%v): want a majority that still lets one pod be evicted", m.pdb.Spec.MinAvailable.String(), k, v, err)
		}
	}
	// Replicas spread over nodes.
	spread := false
	for _, c := range spec.TopologySpreadConstraints {
		if c.TopologyKey == corev1.LabelHostname && c.MaxSkew == 1 && c.LabelSelector != nil && len(c.LabelSelector.MatchExpressions) == 0 && selects(c.LabelSelector.MatchLabels, tmpl.Labels) {
			spread = true
		}
	}
	if !spread {
		t.Errorf("topologySpreadConstraints %+v: want maxSkew 1 over %s, selecting the replicas' pods", spec.TopologySpreadConstraints, corev1.LabelHostname)
	}
	// The scheduler places pods by their requests.
	for _, c := range []*corev1.Container{cf, container(t, spec, "model-server")} {
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
			t.Errorf("container %s: requests %v, want cpu and memory", c.Name, c.Resources.Requests)
		}
	}
	if req, lim := cf.Resources.Requests.StorageEphemeral(), vols["state"].EmptyDir; lim != nil && lim.SizeLimit != nil && req.Cmp(*lim.SizeLimit) < 0 {
		t.Errorf("cfguard requests %v of ephemeral storage, below the state emptyDir's sizeLimit %v", req, lim.SizeLimit)
	}
}

// selects reports whether a non-empty label selector takes a pod with labels.
func selects(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// clusterKeyMount checks that replication.key_file in the replicas' config text lies in a
// read-only mount of the cfguard container from the Secret cfguard-cluster-key, not readable by
// others, and returns the file's path and its key in the Secret.
func clusterKeyMount(t *testing.T, spec *corev1.PodSpec, text string) (file, secretKey string) {
	t.Helper()
	var cfg struct {
		Replication struct {
			KeyFile string `yaml:"key_file"`
		} `yaml:"replication"`
	}
	if err := yaml.Unmarshal([]byte(text), &cfg); err != nil {
		t.Fatal(err)
	}
	file = cfg.Replication.KeyFile
	if file == "" {
		t.Fatal("the replicas' config names no replication.key_file")
	}
	for _, vm := range container(t, spec, "cfguard").VolumeMounts {
		if path.Dir(file) != vm.MountPath {
			continue
		}
		if !vm.ReadOnly {
			t.Errorf("the cluster key's mount %s is not read-only", vm.MountPath)
		}
		for _, v := range spec.Volumes {
			if v.Name != vm.Name || v.Secret == nil {
				continue
			}
			if v.Secret.SecretName != "cfguard-cluster-key" {
				t.Errorf("replication.key_file %s comes from the Secret %s, want cfguard-cluster-key", file, v.Secret.SecretName)
			}
			if v.Secret.DefaultMode == nil || *v.Secret.DefaultMode&0o007 != 0 {
				t.Errorf("the cluster key's Secret volume is readable by others (defaultMode %v)", v.Secret.DefaultMode)
			}
			for _, it := range v.Secret.Items {
				if it.Path == path.Base(file) {
					return file, it.Key
				}
			}
			t.Fatalf("the Secret volume %s does not hold %s", v.Name, path.Base(file))
		}
	}
	t.Fatalf("replication.key_file %s is in no Secret volume the cfguard container mounts", file)
	return "", ""
}

// TestKubernetesReplicaConfigChecks: the replicas' ConfigMap passes `cfguard check-config` (see
// cfguardBinary) in the environment the Deployment gives a pod, which sets the
// advertised URL and mounts the cluster key, and fails it without brokers, with an advertised URL
// that is not one, and without the cluster key's Secret.
func TestKubernetesReplicaConfigChecks(t *testing.T) {
	m := loadReplicaManifests(t)
	spec := &m.deploy.Spec.Template.Spec
	text, _ := cfguardConfigText(t, spec, m.configMap)
	cf := container(t, spec, "cfguard")
	cfguard := cfguardBinary(t)
	// The Secret's file, where the pod would have it mounted: made by the image's gen-key.
	keyPath, _ := clusterKeyMount(t, spec, text)
	key, err := exec.Command(cfguard, "gen-key", "--id", "k1").Output()
	if err != nil {
		t.Fatalf("cfguard gen-key: %v", err)
	}
	mounted := filepath.Join(t.TempDir(), path.Base(keyPath))
	if err := os.WriteFile(mounted, key, 0o440); err != nil {
		t.Fatal(err)
	}
	withoutKey := text
	text = strings.Replace(text, keyPath, mounted, 1)
	good := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(good, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	noSecret := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(noSecret, []byte(withoutKey), 0o600); err != nil {
		t.Fatal(err)
	}
	env := podEnv(t, cf, map[string]string{"status.podIP": replicaPodIP}, map[string]string{"cfguard/http-token": "from-the-secret"})
	checkConfig := func(path string, env map[string]string) ([]byte, error) {
		cmd := exec.Command(cfguard, "check-config", "--config", path)
		cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}
		for k, v := range env {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
		return cmd.CombinedOutput()
	}
	out, err := checkConfig(good, env)
	if err != nil || !bytes.Contains(out, []byte("is valid")) {
		t.Fatalf("cfguard check-config on the replicas' config.yaml in a pod's environment: %v\n%s", err, out)
	}
	var effective struct {
		Replication struct {
			Enabled      bool   `yaml:"enabled"`
			AdvertiseURL string `yaml:"advertise_url"`
		} `yaml:"replication"`
	}
	if err := yaml.Unmarshal(out, &effective); err != nil {
		t.Fatalf("check-config's output: %v\n%s", err, out)
	}
	if want := "http://" + replicaPodIP + ":8080"; effective.Replication.AdvertiseURL != want || !effective.Replication.Enabled {
		t.Errorf("effective replication %+v, want enabled with advertise_url %s", effective.Replication, want)
	}

	refused := func(name, path string, env map[string]string, want ...string) {
		t.Helper()
		out, err := checkConfig(path, env)
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 {
			t.Errorf("%s: check-config %v, want exit 2\n%s", name, err, out)
			return
		}
		for _, w := range want {
			if !bytes.Contains(out, []byte(w)) {
				t.Errorf("%s: check-config's error does not say %q:\n%s", name, w, out)
			}
		}
	}
	refused("without brokers", adaptConfigText(t, []byte(text), map[string]any{"kafka.brokers": []string{}}), env, "replication.enabled", "kafka.brokers")
	bad := map[string]string{}
	for k, v := range env {
		bad[k] = v
	}
	bad["CFGUARD_REPLICATION_ADVERTISE_URL"] = replicaPodIP + ":8080"
	refused("an address, not a URL", good, bad, "CFGUARD_REPLICATION_ADVERTISE_URL", "replication.advertise_url")
	refused("a misspelt replication key", adaptConfigText(t, []byte(text), map[string]any{"replication.session_timeuot": "10s"}), env, "session_timeuot")
	refused("without the cluster key's Secret", noSecret, env, "replication.key_file", "cfguard gen-key")
}
