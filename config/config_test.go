package config

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

func TestDefaultsAreValid(t *testing.T) {
	c, err := Load("")
	if err != nil {
		t.Fatal(err)
	}
	if !c.Embedded() || c.Certify.Delta != 0.05 || c.Kafka.MaxWait != 5*time.Second {
		t.Fatalf("unexpected defaults: %+v", c)
	}
}

func TestRepoConfigYAMLLoads(t *testing.T) {
	c, err := LoadFile(filepath.Join("..", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !c.Embedded() {
		t.Fatal("the repository's config.yaml must run the embedded broker")
	}
	// The README says every key with its default is in config.yaml: the file's keys are those of
	// the effective configuration, and its values are the defaults.
	text, err := os.ReadFile(filepath.Join("..", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	def := Default()
	want, err := def.YAML()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := yamlKeys(t, text), yamlKeys(t, want); !slices.Equal(got, want) {
		t.Errorf("config.yaml's keys differ from the configuration's:\n  only in config.yaml: %v\n  missing from it: %v",
			setMinus(got, want), setMinus(want, got))
	}
	if got, err := c.YAML(); err != nil || string(got) != string(want) {
		t.Errorf("config.yaml's values differ from the defaults (%v):\n%s\nthe defaults:\n%s", err, got, want)
	}
}

// yamlKeys lists the dotted key paths of a YAML mapping's leaves, sorted.
func yamlKeys(t *testing.T, text []byte) []string {
	t.Helper()
	var doc map[string]any
	if err := yaml.Unmarshal(text, &doc); err != nil {
		t.Fatal(err)
	}
	var keys []string
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			if sub, ok := v.(map[string]any); ok {
				walk(prefix+k+".", sub)
				continue
			}
			keys = append(keys, prefix+k)
		}
	}
	walk("", doc)
	slices.Sort(keys)
	return keys
}

func setMinus(a, b []string) []string {
	var out []string
	for _, k := range a {
		if !slices.Contains(b, k) {
			out = append(out, k)
		}
	}
	return out
}

func TestGoodFile(t *testing.T) {
	t.Setenv("CFGUARD_HTTP_TOKEN", "from-env")
	c, err := LoadFile("testdata/good.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.HTTP.Token != "from-env" || c.Embedded() || c.Kafka.MaxWait != 250*time.Millisecond ||
		c.Certify.Mode != "tight" || c.Kafka.GroupID != "cfguard" /* default kept */ {
		t.Fatalf("unexpected config: %+v", c)
	}
}

// TestAdvertiseURLFromEnv: CFGUARD_REPLICATION_ADVERTISE_URL sets replication.advertise_url (a
// pod learns its IP only from the downward API) and is checked as the key is; a single daemon
// ignores it, as it ignores every replication key.
func TestAdvertiseURLFromEnv(t *testing.T) {
	dir := t.TempDir()
	replica := filepath.Join(dir, "replica.yaml")
	single := filepath.Join(dir, "single.yaml")
	for p, text := range map[string]string{
		replica: "kafka:\n  brokers: [kafka.example:9092]\nreplication:\n  enabled: true\n  advertise_url: http://in-the-file:8080\n",
		single:  "replication:\n  advertise_url: http://in-the-file:8080\n",
	} {
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	c, err := LoadFile(replica)
	if err != nil || c.Replication.AdvertiseURL != "http://in-the-file:8080" {
		t.Fatalf("without the variable: %v, %+v", err, c)
	}
	t.Setenv("CFGUARD_REPLICATION_ADVERTISE_URL", "http://10.1.2.3:8080")
	if c, err = LoadFile(replica); err != nil || c.Replication.AdvertiseURL != "http://10.1.2.3:8080" {
		t.Fatalf("with the variable: %v, %+v", err, c)
	}
	t.Setenv("CFGUARD_REPLICATION_ADVERTISE_URL", "10.1.2.3:8080")
	_, err = LoadFile(replica)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "CFGUARD_REPLICATION_ADVERTISE_URL") ||
		!strings.Contains(err.Error(), "replication.advertise_url") {
		t.Fatalf("a URL without a scheme from the environment: %v", err)
	}
	if _, err = LoadFile(single); err != nil {
		t.Fatalf("a single daemon refused for the replication variable: %v", err)
	}
}

func TestBadConfigsNameTheKey(t *testing.T) {
	cases := map[string]struct{ text, want string }{
		"unknown key":        {"kafka:\n  topik: x\n", "topik"},
		"unknown section":    {"kafak:\n  topic: x\n", "kafak"},
		"delta range":        {"certify:\n  delta: 0.7\n", "certify.delta"},
		"delta type":         {"certify:\n  delta: lots\n", "lots"},
		"epsilon":            {"certify:\n  epsilon: -1\n", "certify.epsilon"},
		"policy":             {"certify:\n  on_breach: panic\n", "certify.on_breach"},
		"mode":               {"certify:\n  mode: loose\n", "certify.mode"},
		"duration":           {"kafka:\n  max_wait: soon\n", "soon"},
		"same topics":        {"kafka:\n  topic: a\n  events_topic: a\n", "same topic"},
		"broker":             {"kafka:\n  brokers: [localhost]\n", "kafka.brokers[0]"},
		"sasl":               {"kafka:\n  sasl:\n    mechanism: GSSAPI\n", "kafka.sasl.mechanism"},
		"objective":          {"update:\n  objective: sgd\n", "update.objective"},
		"cron":               {"audit:\n  schedule: every tuesday\n", "audit.schedule"},
		"log level":          {"log:\n  level: loud\n", "log.level"},
		"huge record":        {"kafka:\n  max_record_bytes: 5000000\n", "kafka.max_record_bytes"},
		"not a mapping":      {"- a\n- b\n", "must be a mapping"},
		"section not a map":  {"kafka: 3\n", "kafka (line 1): want a mapping"},
		"enum names the key": {"certify:\n  on_breach: panic\n", "certify.on_breach (line 2): unknown on_breach policy \"panic\""},
		"format":             {"log:\n  format: xml\n", "log.format"},
		"bad type has key":   {"certify:\n  delta: lots\n", "certify.delta (line 2)"},
		"suggestion":         {"kafka:\n  max_recods: 3\n", `did you mean "max_records"`},
		"renamed key":        {"update:\n  steps: 3\n", "update.steps (line 2): unknown key (renamed update.iterations)"},
		"precision":          {"certify:\n  precision: float16\n", "float16"},
		"twice":              {"kafka:\n  topic: a\n  topic: b\n", "kafka.topic (line 3): given twice"},
		"learning rate zero": {"update:\n  learning_rate: 0\n", "update.learning_rate"},
		"negative interval":  {"audit:\n  schedule: \"@every -1s\"\n", "audit.schedule"},
		"zero interval":      {"audit:\n  schedule: \"@every 0s\"\n", "audit.schedule"},
		"sub-second":         {"audit:\n  schedule: \"@every 10ms\"\n", "audit.schedule"},
		"unknown data set":   {"model:\n  dataset: nosuch\n", "model.dataset"},
		"backlog below max_records": {"kafka:\n  max_records: 100\n  max_records_backlog: 50\n",
			"kafka.max_records_backlog: 50: must be >= kafka.max_records (100)"},
		"sasl without username": {"kafka:\n  brokers: [a:1]\n  sasl:\n    mechanism: PLAIN\n", "kafka.sasl.username"},
		// Whole numbers only for integer keys (yaml would truncate 10.5 to 10).
		"fraction for an integer": {"certify:\n  samples: 10.5\n", "certify.samples (line 2): 10.5 is not a whole number"},
		"fraction for a uint":     {"model:\n  seed: 1.5\n", "model.seed (line 2): 1.5 is not a whole number"},
		// A key with no value is not its default.
		"no value":           {"certify:\n  delta:\n", "certify.delta (line 2): the key has no value; give one, or remove the key to keep the default (0.05)"},
		"null value":         {"kafka:\n  max_wait: ~\n", "kafka.max_wait (line 2): the key has no value; give one, or remove the key to keep the default (5s)"},
		"null string":        {"http:\n  token: null\n", "http.token (line 2): the key has no value"},
		"null list":          {"kafka:\n  brokers:\n", "kafka.brokers (line 2): the key has no value"},
		"null top-level":     {"state_dir:\n", "state_dir (line 1): the key has no value"},
		"listen not an addr": {"http:\n  listen: nonsense\n", "http.listen: nonsense: must be host:port"},
		"listen bad port":    {"http:\n  listen: 127.0.0.1:http\n", "http.listen: 127.0.0.1:http: must be host:port with a port number"},
		"listen port range":  {"http:\n  listen: 127.0.0.1:65536\n", "http.listen"},
		"embedded listen":    {"kafka:\n  embedded_listen: localhost\n", "kafka.embedded_listen"},
		"broker port 0":      {"kafka:\n  brokers: [a:0]\n", "kafka.brokers[0]: a:0: must be host:port with a port in 1..65535"},
		"broker no host":     {"kafka:\n  brokers: [\":9092\"]\n", "kafka.brokers[0]"},
		"topic with slash":   {"kafka:\n  topic: \"a b/../c\"\n", `kafka.topic: "a b/../c": holds ' '`},
		"topic too long":     {"kafka:\n  topic: " + strings.Repeat("t", 300) + "\n", "kafka.topic: \"" + strings.Repeat("t", 300) + "\": is 300 characters long; Kafka allows at most 249"},
		"topic dot":          {"kafka:\n  events_topic: \".\"\n", "kafka.events_topic"},
		"topic dotdot":       {"kafka:\n  dead_letter_topic: \"..\"\n", "kafka.dead_letter_topic"},
		"topic NUL":          {"kafka:\n  topic: \"a\\0b\"\n", "kafka.topic"},
		// Upper limits: a typo is refused at load.
		"samples 1e9":        {"certify:\n  samples: 1e9\n", "certify.samples: 1000000000: must be at most 100000"},
		"iterations 2e9":     {"update:\n  iterations: 2e9\n", "update.iterations: 2000000000: must be at most 100000"},
		"update samples":     {"update:\n  samples: 1001\n", "update.samples: 1001: must be at most 1000"},
		"concurrency 1e5":    {"explain:\n  concurrency: 1e5\n", "explain.concurrency: 100000: must be at most 256"},
		"explain iterations": {"explain:\n  max_iterations: 1000001\n", "explain.max_iterations"},
		"backlog over limit": {"kafka:\n  max_records_backlog: 100001\n", "kafka.max_records_backlog: 100001: must be at most 100000"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Load(tc.text)
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrInvalid mentioning %q", err, tc.want)
			}
		})
	}
}

// TestGoodValuesAtTheEdges: the forms and limits the checks above refuse have neighbours that
// are fine.
func TestGoodValuesAtTheEdges(t *testing.T) {
	for _, text := range []string{
		"certify:\n  samples: 1e3\n",    // a whole number written as a float
		"certify:\n  samples: 100000\n", // at the limit
		"update:\n  iterations: 100000\n  samples: 1000\n",
		"explain:\n  concurrency: 256\n  max_iterations: 1000000\n",
		"kafka:\n  max_records_backlog: 100000\n",
		"http:\n  listen: \":8080\"\n",   // every interface
		"http:\n  listen: \"[::1]:0\"\n", // any free port
		"http:\n  listen: localhost:8080\n",
		"kafka:\n  brokers: [\"kafka-0.kafka.svc:9093\", \"[fe80::1]:9092\"]\n",
		"kafka:\n  topic: " + strings.Repeat("t", 249) + "\n",
		"kafka:\n  topic: My_topic-1.v2\n",
		"kafka:\n",               // a section with nothing under it keeps its defaults
		"http:\n  token: \"\"\n", // an empty string is a value
	} {
		if _, err := Load(text); err != nil {
			t.Errorf("%q: %v", text, err)
		}
	}
}

func TestTabsAndMissingFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(p, []byte("kafka:\n\ttopic: x\n"), 0o644)
	if _, err := LoadFile(p); err == nil || !strings.Contains(err.Error(), "tab") {
		t.Fatalf("tabs: %v", err)
	}
	if _, err := LoadFile(filepath.Join(t.TempDir(), "none.yaml")); err == nil || !errors.Is(err, ErrInvalid) {
		t.Fatalf("missing: %v", err)
	}
}

func FuzzLoad(f *testing.F) {
	f.Add("certify:\n  delta: 0.1\n")
	f.Add("kafka:\n  brokers: [a:1]\n")
	f.Fuzz(func(t *testing.T, text string) {
		c, err := Load(text)
		if err == nil {
			if verr := c.Validate(); verr != nil {
				t.Fatalf("Load accepted an invalid config: %v", verr)
			}
		}
	})
}

func TestFilesNamedByTheConfigMustExist(t *testing.T) {
	dir := t.TempDir()
	for name, tc := range map[string]struct{ text, want string }{
		"model path": {"model:\n  path: " + filepath.Join(dir, "nonexistent") + "\n", "model.path"},
		"model file": {"model:\n  path: " + dir + "\n", "model.json"},
		"tls ca":     {"kafka:\n  brokers: [a:1]\n  tls:\n    enabled: true\n    ca_file: " + filepath.Join(dir, "ca.pem") + "\n", "kafka.tls.ca_file"},
	} {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "c.yaml")
			if err := os.WriteFile(p, []byte(tc.text), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := LoadFile(p)
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrInvalid mentioning %q", err, tc.want)
			}
		})
	}
}

func TestEmptyConfigIsAllDefaults(t *testing.T) {
	for _, text := range []string{"", "# nothing\n", "{}\n", "~\n", "---\n"} {
		c, err := Load(text)
		if err != nil {
			t.Fatalf("%q: %v", text, err)
		}
		if !c.Empty() {
			t.Errorf("%q: Empty() = false", text)
		}
	}
	c, err := Load("log:\n  level: debug\n")
	if err != nil {
		t.Fatal(err)
	}
	if c.Empty() {
		t.Error("a config with a key is not empty")
	}
}

// TestYAMLRoundTrip: the printed effective configuration loads back to the same configuration
// (secrets aside, which are redacted), with durations as duration strings.
func TestYAMLRoundTrip(t *testing.T) {
	c, err := LoadFile("testdata/good.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c.Kafka.SASL.Password = "hunter2"
	out, err := c.YAML()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"max_wait: 250ms", "shutdown_timeout: 10s", "token: <redacted>", "password: <redacted>"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("printed config lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "hunter2") || strings.Contains(string(out), "s3cret") {
		t.Fatalf("printed config shows a secret:\n%s", out)
	}
	back, err := Load(string(out))
	if err != nil {
		t.Fatalf("printed config does not load: %v\n%s", err, out)
	}
	back.HTTP.Token, back.Kafka.SASL.Password = c.HTTP.Token, c.Kafka.SASL.Password
	if !reflect.DeepEqual(*back, *c) {
		t.Fatalf("round trip changed the config:\n got %+v\nwant %+v", *back, *c)
	}
}

// TestValidateChecksEnumsOfAConfigBuiltInCode: a Config that did not come through Load (whose
// decoding checks enum names) is checked by Validate, each error naming its key.
func TestValidateChecksEnumsOfAConfigBuiltInCode(t *testing.T) {
	for key, set := range map[string]func(c *Config){
		"certify.mode":        func(c *Config) { c.Certify.Mode = "loose" },
		"certify.on_breach":   func(c *Config) { c.Certify.OnBreach = "ignore" },
		"certify.uncertified": func(c *Config) { c.Certify.Uncertified = "maybe" },
		"certify.precision":   func(c *Config) { c.Certify.Precision = 7 },
		"log.format":          func(c *Config) { c.Log.Format = "xml" },
	} {
		c := Default()
		set(&c)
		if err := c.Validate(); err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), key) {
			t.Errorf("%s set to a bad value in code: Validate = %v, want an error naming %s", key, err, key)
		}
	}
}

func TestReplicationKeys(t *testing.T) {
	const cluster = "kafka:\n  brokers: [127.0.0.1:9092]\n"
	if _, err := Load(cluster + "replication:\n  enabled: true\n"); err != nil {
		t.Fatalf("replication with a shared cluster and the defaults: %v", err)
	}
	// Off, the keys are not checked: a single daemon is never refused for them.
	if _, err := Load("replication:\n  session_timeout: 1ms\n"); err != nil {
		t.Fatalf("replication off with a bad session_timeout: %v", err)
	}
	for _, tc := range []struct{ text, key, why string }{
		{"replication:\n  enabled: true\n", "replication.enabled", "kafka.brokers"},
		{cluster + "replication:\n  enabled: true\n  posterior_topic: \"a b\"\n", "replication.posterior_topic", "topic names"},
		{cluster + "replication:\n  enabled: true\n  posterior_topic: cfguard.events\n", "replication.posterior_topic", "kafka.events_topic"},
		{cluster + "replication:\n  enabled: true\n  replica_id: a/b\n", "replication.replica_id", "'/'"},
		{cluster + "replication:\n  enabled: true\n  ce_topic: cfguard.posterior\n", "replication.ce_topic", "posterior_topic"},
		{cluster + "replication:\n  enabled: true\n  ce_partitions: 0\n", "replication.ce_partitions", "[1, 1024]"},
		{cluster + "replication:\n  enabled: true\n  advertise_url: 10.0.0.1:8080\n", "replication.advertise_url", "http://"},
		{cluster + "replication:\n  enabled: true\n  session_timeout: 999ms\n", "replication.session_timeout", "[1s, 5m]"},
		{cluster + "replication:\n  enabled: true\n  session_timeout: 2s\n  heartbeat_interval: 2s\n", "replication.heartbeat_interval", "below"},
	} {
		_, err := Load(tc.text)
		if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.key) || !strings.Contains(err.Error(), tc.why) {
			t.Errorf("%q: Load = %v, want an error naming %s and saying %q", tc.text, err, tc.key, tc.why)
		}
	}
}
