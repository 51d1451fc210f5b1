package config

import (
	"bytes"
	"errors"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/update"
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
	t.Setenv("CFGUARD_REPLICATION_KEY_FILE", writeKeyFile(t, dir))
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

// writeKeyFile writes a cluster key file in dir and returns its path.
func writeKeyFile(t *testing.T, dir string) string {
	t.Helper()
	line, err := clusterkey.Generate("k1")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "cluster.key")
	if err := os.WriteFile(p, []byte(line), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReplicationNeedsAKeyFile: with replication enabled, a configuration without a readable
// key file is refused, naming replication.key_file and how to make one; the file can come from
// CFGUARD_REPLICATION_KEY_FILE; a single daemon needs none.
func TestReplicationNeedsAKeyFile(t *testing.T) {
	dir := t.TempDir()
	const replica = "kafka:\n  brokers: [kafka.example:9092]\nreplication:\n  enabled: true\n"
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	key := writeKeyFile(t, dir)
	for name, tc := range map[string]struct{ text, want string }{
		"no key_file":        {replica, "cfguard gen-key"},
		"a missing key_file": {replica + "  key_file: " + filepath.Join(dir, "nope.key") + "\n", "nope.key"},
		"a key too short":    {replica + "  key_file: " + write("short.key", "k1:abcd\n") + "\n", "at least 32 bytes"},
	} {
		_, err := LoadFile(write(name+".yaml", tc.text))
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "replication.key_file") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: LoadFile = %v; want ErrInvalid naming replication.key_file and %q", name, err, tc.want)
		}
	}
	if c, err := LoadFile(write("ok.yaml", replica+"  key_file: "+key+"\n")); err != nil || c.Replication.KeyFile != key {
		t.Errorf("with a key file: %v", err)
	}
	t.Setenv("CFGUARD_REPLICATION_KEY_FILE", key)
	if c, err := LoadFile(write("env.yaml", replica)); err != nil || c.Replication.KeyFile != key {
		t.Errorf("with CFGUARD_REPLICATION_KEY_FILE: %v", err)
	}
	t.Setenv("CFGUARD_REPLICATION_KEY_FILE", "")
	if _, err := LoadFile(write("single.yaml", "replication:\n  enabled: false\n")); err != nil {
		t.Errorf("a single daemon: %v", err)
	}
}

func TestBadConfigsNameTheKey(t *testing.T) {
	cases := map[string]struct{ text, want string }{
		"unknown key":        {"kafka:\n  topik: x\n", "topik"},
		"broker conns":       {"kafka:\n  embedded_max_connections: 4\n", "kafka.embedded_max_connections"},
		"broker idle":        {"kafka:\n  embedded_idle_timeout: 10ms\n", "kafka.embedded_idle_timeout"},
		"broker request":     {"kafka:\n  embedded_request_timeout: 0s\n", "kafka.embedded_request_timeout"},
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
		"register wait past the write timeout": {"kafka:\n  brokers: [k.example:9092]\nreplication:\n  enabled: true\n  register_wait: 106s\n",
			"replication.register_wait: 1m46s: must be 0 or more, and more than 15s below http.write_timeout (2m0s)"},
		// A single daemon's predictions with min_version wait for it too.
		"register wait on a single daemon": {"replication:\n  register_wait: -1s\n", "replication.register_wait (line 2): -1s: must be 0 or more"},
		"peer tls pair": {"kafka:\n  brokers: [k.example:9092]\nreplication:\n  enabled: true\n  peer_tls:\n    cert_file: c.pem\n",
			"replication.peer_tls.cert_file"},
		"renamed key": {"update:\n  steps: 3\n", "update.steps (line 2): unknown key (renamed update.iterations)"},
		"a key that counts inputs now": {"http:\n  max_concurrent_predict: 8\n",
			"http.max_concurrent_predict (line 2): unknown key (renamed http.max_predict_inputs, which counts inputs, not requests)"},
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
		"sasl credentials without a mechanism": {"kafka:\n  brokers: [a:1]\n  sasl:\n    username: u\n    password: hunter2\n",
			"kafka.sasl.username (line 4): u: is set but kafka.sasl.mechanism is empty, so the connection to Kafka would not authenticate"},
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
		// The API and the embedded broker on one port: refused at load, naming both keys.
		"listen is the broker's": {"http:\n  listen: 127.0.0.1:9092\n",
			"http.listen: 127.0.0.1:9092: is the address of kafka.embedded_listen (127.0.0.1:9092): the API and the embedded broker each need a port of their own; change one of the two"},
		"listen on localhost, the broker's port": {"http:\n  listen: localhost:7000\nkafka:\n  embedded_listen: 127.0.0.1:7000\n",
			"http.listen: localhost:7000: is the address of kafka.embedded_listen (127.0.0.1:7000)"},
		"every interface spelt long, the broker's port": {"http:\n  listen: \"[0::]:7000\"\nkafka:\n  embedded_listen: 127.0.0.1:7000\n", "takes port 7000"},
		"an IPv4-mapped address, the broker's port":     {"http:\n  listen: \"[::ffff:127.0.0.1]:7000\"\nkafka:\n  embedded_listen: 127.0.0.1:7000\n", "is the address of"},
		"a number for a duration":                       {"http:\n  shutdown_timeout: .inf\n", "http.shutdown_timeout (line 2): cannot unmarshal !!float `.inf` into time.Duration"},
		"a duration without its unit":                   {"kafka:\n  max_wait: 5\n", "kafka.max_wait (line 2): cannot unmarshal !!int `5` into time.Duration (want a duration with its unit, such as 500ms, 5s, 2m or 1h)"},
		"a duration in days":                            {"kafka:\n  max_wait: 1d\n", "kafka.max_wait (line 2): cannot unmarshal !!str `1d` into time.Duration (want a duration with its unit"},
		"an unknown log level":                          {"log:\n  level: verbose\n", "log.level (line 2): slog: level string \"verbose\": unknown name (want debug, info, warn or error)"},
		"infinite seed":                                 {"model:\n  seed: -.inf\n", "model.seed (line 2): -.inf is not a whole number"},
		"seed out of range":                             {"update:\n  seed: -1.0e300\n", "update.seed (line 2): -1.0e300 is out of range"},
		"a zone, no schedule":                           {"audit:\n  schedule: \"TZ=UTC\"\n", "audit.schedule: TZ=UTC: a time zone and no schedule after it"},
		"empty posterior topic":                         {"kafka:\n  brokers: [k:9092]\nreplication:\n  enabled: true\n  posterior_topic: \"\"\n", `replication.posterior_topic: "": must name a topic`},
		"empty CE topic":                                {"kafka:\n  brokers: [k:9092]\nreplication:\n  enabled: true\n  ce_topic: \"\"\n", `replication.ce_topic: "": must name a topic`},
		"LOCALHOST, the broker's port":                  {"http:\n  listen: LOCALHOST:7000\nkafka:\n  embedded_listen: 127.0.0.1:7000\n", "http.listen: LOCALHOST:7000: is the address of"},
		"listen on every interface, the broker's port": {"http:\n  listen: \":7000\"\nkafka:\n  embedded_listen: 127.0.0.1:7000\n",
			"http.listen: :7000: takes port 7000, which is also the port of kafka.embedded_listen (127.0.0.1:7000)"},
		// The embedded broker has no authentication: it listens on loopback only (it refuses any
		// other address as it starts; the configuration says so first).
		"broker on every interface": {"kafka:\n  embedded_listen: \"[::]:7000\"\n",
			"kafka.embedded_listen: [::]:7000: must be a loopback address or localhost"},
		"broker on a LAN address": {"kafka:\n  embedded_listen: 10.1.2.3:9092\n", "kafka.embedded_listen: 10.1.2.3:9092: must be a loopback address"},
		// What yaml would drop or read as a default: each is refused, naming the key.
		"a second document":               {"certify:\n  delta: 0.1\n---\ncertify:\n  on_breach: reject\n", "line 3: another YAML document"},
		"a third document":                {"certify:\n  delta: 0.1\n---\n# nothing\n---\nbogus: 1\n", "line 5: another YAML document"},
		"kl_weight NaN":                   {"update:\n  kl_weight: .nan\n", "update.kl_weight: NaN: must be finite and >= 0"},
		"kl_weight Inf":                   {"update:\n  kl_weight: .inf\n", "update.kl_weight: +Inf: must be finite and >= 0"},
		"hoeffding_alpha NaN":             {"certify:\n  hoeffding_alpha: .nan\n", "certify.hoeffding_alpha: NaN: must be in [0, 1)"},
		"an interval in a zone":           {"audit:\n  schedule: \"TZ=UTC @every -1s\"\n", "audit.schedule: TZ=UTC @every -1s: the interval must be at least 1s"},
		"a sub-second interval in a zone": {"audit:\n  schedule: \"CRON_TZ=Europe/Paris @every 10ms\"\n", "audit.schedule"},
		"explain timeout":                 {"explain:\n  timeout: 0s\n", "explain.timeout: 0s: must be positive"},
		"explain iterations 0":            {"explain:\n  max_iterations: 0\n", "explain.max_iterations: 0: must be positive"},
		"explain concurrency":             {"explain:\n  concurrency: -1\n", "explain.concurrency: -1: must be 0 (one per core) or positive"},
		"empty mode":                      {"certify:\n  mode: \"\"\n", "certify.mode (line 2)"},
		"empty client id":                 {"kafka:\n  client_id: \"\"\n", `kafka.client_id: "": must be set`},
		// localhost may bind ::1 (a host without IPv4 loopback): it shares a port with [::1], either way round.
		"listen on localhost, the broker on [::1]": {"http:\n  listen: localhost:7000\nkafka:\n  embedded_listen: \"[::1]:7000\"\n",
			"http.listen: localhost:7000: is the address of kafka.embedded_listen ([::1]:7000)"},
		"listen on [::1], the broker on localhost": {"http:\n  listen: \"[::1]:7000\"\nkafka:\n  embedded_listen: localhost:7000\n",
			"http.listen: [::1]:7000: is the address of kafka.embedded_listen (localhost:7000)"},
		// 9.223372036854775808e18 is 2^63, one past the largest int64: yaml would store it as the
		// smallest int64, which this key reads as "no size limit".
		"an integer key at 2^63": {"kafka:\n  embedded_retention_bytes: 9.223372036854775808e18\n",
			"kafka.embedded_retention_bytes (line 2): 9.223372036854775808e18 is out of range"},
		// Suggestions reach edit distance 2 (a transposition).
		"suggestion two edits away": {"kafka:\n  topci: x\n", `kafka.topci (line 2): unknown key (did you mean "topic"?)`},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Load(tc.text)
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(withoutLines(err), tc.want) && !strings.Contains(err.Error(), tc.want) {
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
		"http:\n  listen: 127.0.0.1:0\nkafka:\n  embedded_listen: 127.0.0.1:0\n",       // two free ports, not one
		"http:\n  listen: 127.0.0.2:9092\n",                                            // the broker's port on another address
		"http:\n  listen: \"[::1]:9092\"\n",                                            // and on the other loopback
		"http:\n  listen: 127.0.0.2:7000\nkafka:\n  embedded_listen: localhost:7000\n", // localhost is 127.0.0.1
		"http:\n  listen: 127.0.0.1:9092\nkafka:\n  brokers: [\"kafka:9092\"]\n",       // no embedded broker
		"kafka:\n  brokers: [\"kafka-0.kafka.svc:9093\", \"[fe80::1]:9092\"]\n",
		"kafka:\n  topic: " + strings.Repeat("t", 249) + "\n",
		"kafka:\n  topic: My_topic-1.v2\n",
		"kafka:\n",               // a section with nothing under it keeps its defaults
		"http:\n  token: \"\"\n", // an empty string is a value
		"log:\n  format: json\n",
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
	// A model directory whose model.json is a directory; a web configuration asking for basic
	// auth, and one whose certificate is not there.
	notFile := filepath.Join(dir, "model")
	for _, d := range []string{filepath.Join(notFile, "model.json"), filepath.Join(dir, "web")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	users := filepath.Join(dir, "web", "users.yml")
	noCert := filepath.Join(dir, "web", "nocert.yml")
	for p, text := range map[string]string{
		users:  "basic_auth_users:\n  ops: $2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi\n",
		noCert: "tls_server_config:\n  cert_file: missing.pem\n  key_file: missing.key\n",
	} {
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Model directories run would refuse: weights cut short, two classes of one name (written
	// past Save, which refuses it); and a good one, exported into by model.export_dir.
	truncated, dupClasses, good, noWeights := filepath.Join(dir, "truncated"), filepath.Join(dir, "dup"), filepath.Join(dir, "good"), filepath.Join(dir, "noweights")
	for _, d := range []string{truncated, dupClasses, good, noWeights} {
		if err := bnn.Save(d, bnn.New(3, []int{4}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(1, 2)))); err != nil {
			t.Fatal(err)
		}
	}
	w := filepath.Join(truncated, bnn.WeightsFile)
	raw, err := os.ReadFile(w)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(w, raw[:len(raw)/2], 0o644)
	sc := filepath.Join(dupClasses, bnn.SidecarFile)
	js, _ := os.ReadFile(sc)
	os.WriteFile(sc, bytes.Replace(js, []byte(`"yes"`), []byte(`"no"`), 1), 0o644)
	if err := os.Remove(filepath.Join(noWeights, bnn.WeightsFile)); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(good, link); err != nil {
		t.Fatal(err)
	}
	tls := "kafka:\n  brokers: [a:1]\n  tls:\n    enabled: true\n"
	replica := "kafka:\n  brokers: [kafka.example:9092]\nreplication:\n  enabled: true\n  key_file: " + writeKeyFile(t, dir) + "\n"
	for name, tc := range map[string]struct{ text, want string }{
		"model path":      {"model:\n  path: " + filepath.Join(dir, "nonexistent") + "\n", "model.path"},
		"model file":      {"model:\n  path: " + dir + "\n", "model.json"},
		"model not file":  {"model:\n  path: " + notFile + "\n", "model.path: " + filepath.Join(notFile, "model.json") + " is not a regular file"},
		"model truncated": {"model:\n  path: " + truncated + "\n", "model.path: load model " + truncated + ": "},
		"model classes":   {"model:\n  path: " + dupClasses + "\n", `class names 0 and 1 are both "no"`},
		"export into the model": {"model:\n  path: " + good + "\n  export_dir: " + good + "/.\n",
			"model.export_dir: " + good + "/. is model.path's directory"},
		"export through a link": {"model:\n  path: " + good + "\n  export_dir: " + link + "\n", "model.export_dir: " + link},
		"state dir a file":      {"state_dir: " + users + "\n", "state_dir: " + users + " is not a directory"},
		"export dir a file":     {"model:\n  export_dir: " + users + "\n", "model.export_dir: " + users + " is not a directory"},
		"tls ca":                {tls + "    ca_file: " + filepath.Join(dir, "ca.pem") + "\n", "kafka.tls.ca_file"},
		"tls cert":              {tls + "    cert_file: " + filepath.Join(dir, "c.pem") + "\n    key_file: " + users + "\n", "kafka.tls.cert_file"},
		"tls key":               {tls + "    cert_file: " + users + "\n    key_file: " + filepath.Join(dir, "k.pem") + "\n", "kafka.tls.key_file"},
		"tls ca not pem":        {tls + "    ca_file: " + users + "\n", "kafka.tls.ca_file: " + users + " holds no PEM certificate"},
		"web config":            {"http:\n  web_config_file: " + filepath.Join(dir, "web.yml") + "\n", "http.web_config_file"},
		"web config tls":        {"http:\n  web_config_file: " + noCert + "\n", "http.web_config_file: " + noCert},
		"basic auth beside a token": {"http:\n  web_config_file: " + users + "\n  metrics_token: m\n",
			"http.web_config_file: " + users + " sets basic_auth_users while http.token or http.metrics_token is set"},
		"basic auth on a replica": {replica + "http:\n  web_config_file: " + users + "\n",
			"http.web_config_file: " + users + " sets basic_auth_users on a replica"},
		"peer tls ca": {replica + "  peer_tls:\n    ca_file: " + filepath.Join(dir, "peers.pem") + "\n", "replication.peer_tls.ca_file"},
		"basic auth beside the API token": {"http:\n  web_config_file: " + users + "\n  token: t\n",
			"http.web_config_file: " + users + " sets basic_auth_users while http.token or http.metrics_token is set"},
		// LoadFile finds both files of a model directory (CheckModel, not called here, loads them).
		"weights missing": {"model:\n  path: " + noWeights + "\n", "model.path: " + noWeights + ": stat " + filepath.Join(noWeights, bnn.WeightsFile)},
		"peer tls key pair": {replica + "  peer_tls:\n    cert_file: " + users + "\n    key_file: " + users + "\n",
			"replication.peer_tls.cert_file " + users + " / replication.peer_tls.key_file " + users},
	} {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "c.yaml")
			if err := os.WriteFile(p, []byte(tc.text), 0o644); err != nil {
				t.Fatal(err)
			}
			c, err := LoadFile(p)
			if strings.HasPrefix(name, "model ") && err == nil {
				err = c.CheckModel() // check-config and run load the model; LoadFile only finds its files
			}
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
	c, err := Load(cluster + "replication:\n  enabled: true\n  ce_partitions: &n 12\n  skip_ce_requests: [{partition: 11, offset: 0}, &e {partition: 3, offset: 1200, id: ce-7}, " +
		"{partition: 0, offset: 10, through: 99}, *e, {partition: 1, offset: *n, id: 123}]\n")
	if err != nil || !slices.Equal(c.Replication.SkipCERequests, CERequests{{Partition: 11}, {Partition: 3, Offset: 1200, ID: "ce-7"}, {Offset: 10, Through: 99},
		{Partition: 3, Offset: 1200, ID: "ce-7"}, {Partition: 1, Offset: 12, ID: "123"}}) {
		t.Fatalf("skip_ce_requests: %v, %+v", err, c)
	}
	// Off, the keys are not checked: a single daemon is never refused for them.
	if _, err := Load("replication:\n  session_timeout: 1ms\n"); err != nil {
		t.Fatalf("replication off with a bad session_timeout: %v", err)
	}
	// Off, the items of skip_ce_requests are still checked (all but the partition's upper bound,
	// replication.ce_partitions, which is checked with the other keys only when on).
	if _, err := Load("replication:\n  skip_ce_requests: [{partition: 99, offset: 1, id: ce-1}]\n"); err != nil {
		t.Fatalf("replication off, a skip_ce_requests partition above ce_partitions: %v", err)
	}
	for _, tc := range []struct{ text, key, why string }{
		{"replication:\n  skip_ce_requests: [{partition: 1, offset: 1, id: \"a b\"}]\n", "replication.skip_ce_requests[0]", "not in [A-Za-z0-9._:-]"},
		{"replication:\n  skip_ce_requests: [{partition: 1, offset: 5, through: 9, id: a}]\n", "replication.skip_ce_requests[0]", "an id names one request"},
		{"replication:\n  skip_ce_requests: [{partition: 1, offset: 5, through: 4}]\n", "replication.skip_ce_requests", "through 4 is below offset 5"},
	} {
		if _, err := Load(tc.text); err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(withoutLines(err), tc.key) || !strings.Contains(err.Error(), tc.why) {
			t.Errorf("replication off, %q: Load = %v, want an error naming %s and saying %q", tc.text, err, tc.key, tc.why)
		}
	}
	off := Default()
	off.Replication.SkipCERequests = CERequests{{Partition: -1, Offset: 1}}
	if err := off.Validate(); err == nil || !strings.Contains(err.Error(), "replication.skip_ce_requests[0]: partition -1: needs a partition of 0 or more") {
		t.Errorf("replication off, a negative partition built in code: Validate = %v", err)
	}
	for _, tc := range []struct{ text, key, why string }{
		{"replication:\n  enabled: true\n", "replication.enabled", "kafka.brokers"},
		{cluster + "replication:\n  enabled: true\n  posterior_topic: \"a b\"\n", "replication.posterior_topic", "topic names"},
		{cluster + "replication:\n  enabled: true\n  posterior_topic: cfguard.events\n", "replication.posterior_topic", "kafka.events_topic"},
		{cluster + "replication:\n  enabled: true\n  replica_id: a/b\n", "replication.replica_id", "'/'"},
		{cluster + "replication:\n  enabled: true\n  ce_topic: cfguard.posterior\n", "replication.ce_topic", "posterior_topic"},
		{cluster + "replication:\n  enabled: true\n  ce_partitions: 0\n", "replication.ce_partitions", "[1, 1024]"},
		{"kafka:\n  brokers: [127.0.0.1:9092]\n  events_topic: cfguard.ce.state\nreplication:\n  enabled: true\n", "kafka.events_topic", "CE state topic"},
		{cluster + "replication:\n  enabled: true\n  ce_topic: " + strings.Repeat("c", 246) + "\n", "replication.ce_topic", "its state topic"},
		{cluster + "replication:\n  enabled: true\n  advertise_url: 10.0.0.1:8080\n", "replication.advertise_url", "http://"},
		{cluster + "replication:\n  enabled: true\n  session_timeout: 999ms\n", "replication.session_timeout", "[1s, 5m]"},
		{cluster + "replication:\n  enabled: true\n  session_timeout: 2s\n  heartbeat_interval: 2s\n", "replication.heartbeat_interval", "below"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 12, offset: 3}]\n", "replication.skip_ce_requests[0]: partition 12", "[0, 12)"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: -1}]\n", "replication.skip_ce_requests", "offset \"-1\": want a whole number of decimal digits"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 3, offset: 012}]\n", "replication.skip_ce_requests", "offset \"012\": want a whole number of decimal digits"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 3, offset: 0x12}]\n", "replication.skip_ce_requests", "offset \"0x12\""},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 3, offset: 1_200}]\n", "replication.skip_ce_requests", "offset \"1_200\""},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 3, offset: +1}]\n", "replication.skip_ce_requests", "offset \"+1\""},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 010, offset: 1}]\n", "replication.skip_ce_requests", "partition \"010\""},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 2.5}]\n", "replication.skip_ce_requests", "offset \"2.5\""},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, ofset: 3}]\n", "replication.skip_ce_requests", "unknown key \"ofset\""},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1}]\n", "replication.skip_ce_requests", "want both partition and offset"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [3]\n", "replication.skip_ce_requests", "want {partition: P, offset: O}"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [~]\n", "replication.skip_ce_requests", "want {partition: P, offset: O}, got the value \"~\""},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests:\n    - {partition: 1, offset: 3}\n    -\n\n", "replication.skip_ce_requests", "item on line 7: want {partition: P, offset: O}, got the value \"\""},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: {partition: 1, offset: 3}\n", "replication.skip_ce_requests", "(line 5): want a list of {partition: P, offset: O}, got a mapping"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 5, through: 4}]\n", "replication.skip_ce_requests", "through 4 is below offset 5"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 5, through: 0}]\n", "replication.skip_ce_requests", "through 0 is below offset 5"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 5, id: \"\"}]\n", "replication.skip_ce_requests", "an empty id names no request"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 9223372036854775808}]\n", "replication.skip_ce_requests", "offset 9223372036854775808 is out of range"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 99999999999999999999}]\n", "replication.skip_ce_requests", "offset 99999999999999999999 is out of range"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 2147483648, offset: 1}]\n", "replication.skip_ce_requests", "partition 2147483648 is out of range"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: [5]}]\n", "replication.skip_ce_requests", "offset: want a value, got a list"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 5, through: 9, id: a}]\n", "replication.skip_ce_requests[0]", "an id names one request"},
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 5, id: \"a b\"}]\n", "replication.skip_ce_requests[0]", "not in [A-Za-z0-9._:-]"},
		// yaml leaves a repeated key of a flow mapping to its reader: the second offset must not win in silence.
		{cluster + "replication:\n  enabled: true\n  skip_ce_requests: [{partition: 1, offset: 2, offset: 3}]\n", "replication.skip_ce_requests", "offset given twice"},
	} {
		_, err := Load(tc.text)
		if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(withoutLines(err), tc.key) || !strings.Contains(err.Error(), tc.why) {
			t.Errorf("%q: Load = %v, want an error naming %s and saying %q", tc.text, err, tc.key, tc.why)
		}
	}
}

// TestSameBadFileSameMessage: a file with several errors, among them rules that check a group of
// keys (the HTTP timeouts, the three topics; the TLS files, checked once the values are valid),
// gives the same message on every load, so that a message can be compared, searched for and
// quoted; the errors of a group come in the order of its keys.
func TestSameBadFileSameMessage(t *testing.T) {
	dir := t.TempDir()
	values := "http:\n  read_header_timeout: 0s\n  read_timeout: 0s\n  write_timeout: 0s\n  idle_timeout: 0s\n" +
		"kafka:\n  brokers: [a:1]\n  topic: t\n  dead_letter_topic: t\n  events_topic: t\n"
	files := "kafka:\n  brokers: [a:1]\n  tls:\n    enabled: true\n    ca_file: " + filepath.Join(dir, "ca.pem") + "\n" +
		"    cert_file: " + filepath.Join(dir, "cert.pem") + "\n    key_file: " + filepath.Join(dir, "key.pem") + "\n"
	for _, tc := range []struct {
		name, text string
		want       []string
	}{
		{"values", values, []string{"http.read_header_timeout", "http.read_timeout", "http.write_timeout", "http.idle_timeout",
			"kafka.dead_letter_topic: t: is the same topic as kafka.topic", "kafka.events_topic: t: is the same topic as kafka.topic"}},
		{"files", files, []string{"kafka.tls.ca_file", "kafka.tls.cert_file", "kafka.tls.key_file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, tc.name+".yaml")
			if err := os.WriteFile(p, []byte(tc.text), 0o644); err != nil {
				t.Fatal(err)
			}
			msgs := map[string]int{}
			for range 50 {
				_, err := LoadFile(p)
				if err == nil {
					t.Fatal("the bad file loads")
				}
				msgs[err.Error()]++
			}
			if len(msgs) != 1 {
				t.Fatalf("%d different messages in 50 loads of one file:\n%s", len(msgs), strings.Join(slices.Collect(maps.Keys(msgs)), "\n----\n"))
			}
			for msg := range msgs {
				if !inOrder(withoutLines(errors.New(msg)), tc.want) {
					t.Fatalf("LoadFile = %v\nwant, in this order: %q", msg, tc.want)
				}
			}
		})
	}
}

// inOrder reports whether s holds every fragment of want, each after the one before.
func inOrder(s string, want []string) bool {
	for _, w := range want {
		i := strings.Index(s, w)
		if i < 0 {
			return false
		}
		s = s[i+len(w):]
	}
	return true
}

// TestValidateRejectsEachKey: every rule of Validate refuses a bad value with one error that
// names its key and says what is wanted, and accepts the nearest good value (edge, when the rule
// is a bound). Each case starts from the defaults and breaks one key.
func TestValidateRejectsEachKey(t *testing.T) {
	cases := []keyCase{
		{"http.listen", "must be host:port", func(c *Config) { c.HTTP.Listen = "" }, nil},
		{"http.listen", "with a port number", func(c *Config) { c.HTTP.Listen = "127.0.0.1:http" }, func(c *Config) { c.HTTP.Listen = "127.0.0.1:0" }},
		{"http.shutdown_timeout", "must be positive", func(c *Config) { c.HTTP.ShutdownTimeout = 0 }, func(c *Config) { c.HTTP.ShutdownTimeout = 1 }},
		{"http.max_body_bytes", "must be positive", func(c *Config) { c.HTTP.MaxBodyBytes = 0 }, func(c *Config) { c.HTTP.MaxBodyBytes = 1 }},
		{"http.read_header_timeout", "must be positive", func(c *Config) { c.HTTP.ReadHeaderTimeout = 0 }, func(c *Config) { c.HTTP.ReadHeaderTimeout = 1 }},
		{"http.read_timeout", "must be positive", func(c *Config) { c.HTTP.ReadTimeout = -time.Second }, func(c *Config) { c.HTTP.ReadTimeout = 1 }},
		{"http.write_timeout", "must be positive", func(c *Config) { c.HTTP.WriteTimeout = 0 }, func(c *Config) { c.HTTP.WriteTimeout = 1 }},
		{"http.idle_timeout", "must be positive", func(c *Config) { c.HTTP.IdleTimeout = 0 }, func(c *Config) { c.HTTP.IdleTimeout = 1 }},
		{"http.max_connections", "must be positive", func(c *Config) { c.HTTP.MaxConnections = 0 }, func(c *Config) { c.HTTP.MaxConnections = 1 }},
		{"http.max_predict_inputs", "must be >= 0", func(c *Config) { c.HTTP.MaxPredictInputs = -1 }, func(c *Config) { c.HTTP.MaxPredictInputs = 0 }},
		{"http.idempotency_window", "must be at least 1m", func(c *Config) { c.HTTP.IdempotencyWindow = 59 * time.Second }, func(c *Config) { c.HTTP.IdempotencyWindow = time.Minute }},
		{"state_dir", "must name a directory", func(c *Config) { c.StateDir = "" }, nil},
		{"model.dataset", "needed when model.path is empty", func(c *Config) { c.Model.Dataset = "" }, func(c *Config) { c.Model.Dataset, c.Model.Path = "", "m" }},
		{"model.dataset", "not a bundled data set", func(c *Config) { c.Model.Dataset = "nosuch" }, nil},
		{"model.epochs", "must be >= 0", func(c *Config) { c.Model.Epochs = -1 }, func(c *Config) { c.Model.Epochs = 0 }},
		{"kafka.brokers[1]", "must be host:port with a port in 1..65535", func(c *Config) { c.Kafka.Brokers = []string{"a:1", "b:0"} }, func(c *Config) { c.Kafka.Brokers = []string{"a:1", "b:65535"} }},
		{"kafka.embedded_listen", "must be host:port", func(c *Config) { c.Kafka.EmbeddedListen = "localhost" }, func(c *Config) { c.Kafka.EmbeddedListen = "localhost:0" }},
		{"kafka.topic", "must name a topic", func(c *Config) { c.Kafka.Topic = "" }, nil},
		{"kafka.dead_letter_topic", "must name a topic", func(c *Config) { c.Kafka.DeadLetterTopic = "" }, nil},
		{"kafka.events_topic", "must name a topic", func(c *Config) { c.Kafka.EventsTopic = "" }, nil},
		{"kafka.events_topic", "is the same topic as kafka.topic", func(c *Config) { c.Kafka.EventsTopic = c.Kafka.Topic }, nil},
		{"kafka.dead_letter_topic", "Kafka allows at most 249", func(c *Config) { c.Kafka.DeadLetterTopic = strings.Repeat("d", 250) },
			func(c *Config) { c.Kafka.DeadLetterTopic = strings.Repeat("d", 249) }},
		{"kafka.topic", "Kafka topic names may hold only", func(c *Config) { c.Kafka.Topic = "a/b" }, nil},
		{"kafka.group_id", "must be set", func(c *Config) { c.Kafka.GroupID = "" }, nil},
		{"kafka.max_records", "must be positive", func(c *Config) { c.Kafka.MaxRecords = 0 }, func(c *Config) { c.Kafka.MaxRecords = 1 }},
		{"kafka.max_records_backlog", "must be >= kafka.max_records", func(c *Config) { c.Kafka.MaxRecordsBacklog = c.Kafka.MaxRecords - 1 },
			func(c *Config) { c.Kafka.MaxRecordsBacklog = c.Kafka.MaxRecords }},
		{"kafka.max_records_backlog", "must be at most 100000", func(c *Config) { c.Kafka.MaxRecordsBacklog = MaxKafkaRecordsBacklog + 1 },
			func(c *Config) { c.Kafka.MaxRecordsBacklog = MaxKafkaRecordsBacklog }},
		{"kafka.max_wait", "must be positive", func(c *Config) { c.Kafka.MaxWait = 0 }, func(c *Config) { c.Kafka.MaxWait = 1 }},
		{"kafka.embedded_retention", "must be positive, or negative", func(c *Config) { c.Kafka.EmbeddedRetention = 0 }, func(c *Config) { c.Kafka.EmbeddedRetention = -1 }},
		{"kafka.embedded_retention_bytes", "must be positive, or negative", func(c *Config) { c.Kafka.EmbeddedRetentionBytes = 0 },
			func(c *Config) { c.Kafka.EmbeddedRetentionBytes = -1 }},
		{"kafka.max_record_bytes", "must be in (0, 900000]", func(c *Config) { c.Kafka.MaxRecordBytes = 0 }, func(c *Config) { c.Kafka.MaxRecordBytes = 1 }},
		{"kafka.max_record_bytes", "must be in (0, 900000]", func(c *Config) { c.Kafka.MaxRecordBytes = 900_001 }, func(c *Config) { c.Kafka.MaxRecordBytes = 900_000 }},
		{"kafka.sasl.mechanism", "must be PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
			func(c *Config) {
				c.Kafka.Brokers, c.Kafka.SASL.Mechanism, c.Kafka.SASL.Username = []string{"k:9092"}, "GSSAPI", "u"
			},
			func(c *Config) {
				c.Kafka.Brokers, c.Kafka.SASL.Mechanism, c.Kafka.SASL.Username = []string{"k:9092"}, "SCRAM-SHA-512", "u"
			}},
		{"kafka.sasl.username", "needed with a SASL mechanism", func(c *Config) { c.Kafka.Brokers, c.Kafka.SASL.Mechanism = []string{"k:9092"}, "PLAIN" }, nil},
		{"kafka.sasl.username", "is set but kafka.sasl.mechanism is empty, so the connection to Kafka would not authenticate: set kafka.sasl.mechanism",
			func(c *Config) { c.Kafka.Brokers, c.Kafka.SASL.Username = []string{"k:9092"}, "u" },
			func(c *Config) {
				c.Kafka.Brokers, c.Kafka.SASL.Mechanism, c.Kafka.SASL.Username = []string{"k:9092"}, "PLAIN", "u"
			}},
		{"kafka.sasl.password", "<redacted>: is set but kafka.sasl.mechanism is empty, so the connection to Kafka would not authenticate: set kafka.sasl.mechanism",
			func(c *Config) { c.Kafka.Brokers, c.Kafka.SASL.Password = []string{"k:9092"}, "hunter2" },
			func(c *Config) {
				c.Kafka.Brokers, c.Kafka.SASL.Mechanism, c.Kafka.SASL.Username, c.Kafka.SASL.Password = []string{"k:9092"}, "PLAIN", "u", "hunter2"
			}},
		{"kafka.sasl.mechanism", "the embedded broker (kafka.brokers empty) has no authentication", func(c *Config) { c.Kafka.SASL.Mechanism, c.Kafka.SASL.Username = "PLAIN", "u" },
			func(c *Config) {
				c.Kafka.Brokers, c.Kafka.SASL.Mechanism, c.Kafka.SASL.Username = []string{"k:9092"}, "PLAIN", "u"
			}},
		{"kafka.tls.enabled", "the embedded broker (kafka.brokers empty) speaks plain Kafka", func(c *Config) { c.Kafka.TLS.Enabled = true },
			func(c *Config) { c.Kafka.Brokers, c.Kafka.TLS.Enabled = []string{"k:9092"}, true }},
		{"kafka.tls.cert_file", "cert_file and key_file go together", func(c *Config) {
			c.Kafka.Brokers, c.Kafka.TLS.Enabled, c.Kafka.TLS.KeyFile = []string{"k:9092"}, true, "k.pem"
		}, func(c *Config) {
			c.Kafka.Brokers, c.Kafka.TLS.Enabled, c.Kafka.TLS.CertFile, c.Kafka.TLS.KeyFile = []string{"k:9092"}, true, "c.pem", "k.pem"
		}},
		{"kafka.tls.ca_file", "kafka.tls.enabled is false, so the connection to Kafka would not use TLS", func(c *Config) {
			c.Kafka.Brokers, c.Kafka.TLS.CAFile = []string{"k:9092"}, "ca.pem"
		}, func(c *Config) {
			c.Kafka.Brokers, c.Kafka.TLS.Enabled, c.Kafka.TLS.CAFile = []string{"k:9092"}, true, "ca.pem"
		}},
		{"kafka.tls.insecure_skip_verify", "there is no TLS to verify", func(c *Config) {
			c.Kafka.Brokers, c.Kafka.TLS.InsecureSkipVerify = []string{"k:9092"}, true
		}, func(c *Config) {
			c.Kafka.Brokers, c.Kafka.TLS.Enabled, c.Kafka.TLS.InsecureSkipVerify = []string{"k:9092"}, true, true
		}},
		{"update.objective", "must be prior or vcl", func(c *Config) { c.Update.Objective = "sgd" }, func(c *Config) { c.Update.Objective = "vcl" }},
		{"update.learning_rate", "must be in (0, 1]", func(c *Config) { c.Update.LearningRate = 0 }, nil},
		{"update.learning_rate", "must be in (0, 1]", func(c *Config) { c.Update.LearningRate = math.Nextafter(1, 2) }, func(c *Config) { c.Update.LearningRate = 1 }},
		{"update.learning_rate", "must be in (0, 1]", func(c *Config) { c.Update.LearningRate = math.NaN() }, nil},
		{"update.iterations", "must be >= 1", func(c *Config) { c.Update.Iterations = 0 }, func(c *Config) { c.Update.Iterations = 1 }},
		{"update.iterations", "must be at most 100000", func(c *Config) { c.Update.Iterations = MaxUpdateIterations + 1 }, func(c *Config) { c.Update.Iterations = MaxUpdateIterations }},
		{"update.samples", "must be >= 1", func(c *Config) { c.Update.Samples = 0 }, func(c *Config) { c.Update.Samples = 1 }},
		{"update.samples", "must be at most 1000", func(c *Config) { c.Update.Samples = MaxUpdateSamples + 1 }, func(c *Config) { c.Update.Samples = MaxUpdateSamples }},
		{"update.kl_weight", "must be finite and >= 0", func(c *Config) { c.Update.KLWeight = -1e-9 }, func(c *Config) { c.Update.KLWeight = 0 }},
		{"certify.delta", "must be within (0, 0.5)", func(c *Config) { c.Certify.Delta = 0.5 }, func(c *Config) { c.Certify.Delta = math.Nextafter(0.5, 0) }},
		{"certify.delta", "must be within (0, 0.5)", func(c *Config) { c.Certify.Delta = 0 }, nil},
		{"certify.epsilon", "must be within (0, 0.25]", func(c *Config) { c.Certify.Epsilon = 0 }, func(c *Config) { c.Certify.Epsilon = 0.25 }},
		{"certify.epsilon_max", "must be in [certify.epsilon, 0.25]", func(c *Config) { c.Certify.EpsilonMax = math.Nextafter(c.Certify.Epsilon, 0) },
			func(c *Config) { c.Certify.EpsilonMax = c.Certify.Epsilon }},
		{"certify.epsilon_max", "must be in [certify.epsilon, 0.25]", func(c *Config) { c.Certify.EpsilonMax = math.Nextafter(0.25, 1) }, nil},
		{"certify.samples", "must be >= 2", func(c *Config) { c.Certify.Samples = 1 }, nil},
		// At delta 0.05 and verdict_alpha 0.01, 7 ln(200) / (3 (S - 1)) < 0.05 needs S >= 249.
		{"certify.samples", "must be >= 249", func(c *Config) { c.Certify.Samples = 248 }, func(c *Config) { c.Certify.Samples = 249 }},
		{"certify.samples", "must be at most 100000", func(c *Config) { c.Certify.Samples = MaxCertifySamples + 1 }, func(c *Config) { c.Certify.Samples = MaxCertifySamples }},
		{"certify.verdict_alpha", "must be in (0, 0.5)", func(c *Config) { c.Certify.VerdictAlpha = 0 }, nil},
		{"certify.verdict_alpha", "must be in (0, 0.5)", func(c *Config) { c.Certify.VerdictAlpha = 0.5 }, func(c *Config) { c.Certify.VerdictAlpha = 0.499 }},
		{"certify.hoeffding_alpha", "must be in [0, 1)", func(c *Config) { c.Certify.HoeffdingAlpha = -0.01 }, func(c *Config) { c.Certify.HoeffdingAlpha = 0 }},
		{"certify.hoeffding_alpha", "must be in [0, 1)", func(c *Config) { c.Certify.HoeffdingAlpha = 1 }, func(c *Config) { c.Certify.HoeffdingAlpha = 0.999 }},
		// At 1000 draws and delta 0.45, sqrt(ln(1/alpha) / 2000) <= 0.05 needs alpha >= e^-5 = 0.0067.
		{"certify.hoeffding_alpha", "exceeds 1/2 - delta = 0.05", func(c *Config) { c.Certify.Samples, c.Certify.Delta, c.Certify.HoeffdingAlpha = 1000, 0.45, 0.0067 },
			func(c *Config) { c.Certify.Samples, c.Certify.Delta, c.Certify.HoeffdingAlpha = 1000, 0.45, 0.0068 }},
		{"certify.mode", "unknown bound mode", func(c *Config) { c.Certify.Mode = "loose" }, nil},
		{"certify.on_breach", "unknown on_breach policy", func(c *Config) { c.Certify.OnBreach = "ignore" }, nil},
		{"certify.uncertified", "want refuse or store", func(c *Config) { c.Certify.Uncertified = "maybe" }, nil},
		{"certify.precision", "want float64 or float32", func(c *Config) { c.Certify.Precision = 7 }, nil},
		{"log.format", "unknown log format", func(c *Config) { c.Log.Format = "xml" }, nil},
		{"audit.workers", "must be 0 (every core but one) or 1..256", func(c *Config) { c.Audit.Workers = -1 }, func(c *Config) { c.Audit.Workers = 0 }},
		{"audit.workers", "must be 0 (every core but one) or 1..256", func(c *Config) { c.Audit.Workers = MaxAuditWorkers + 1 }, func(c *Config) { c.Audit.Workers = MaxAuditWorkers }},
		{"audit.schedule", "the interval must be at least 1s", func(c *Config) { c.Audit.Schedule = "@every 999ms" }, func(c *Config) { c.Audit.Schedule = "@every 1s" }},
		{"audit.schedule", "expected exactly 5 fields", func(c *Config) { c.Audit.Schedule = "every tuesday" }, func(c *Config) { c.Audit.Schedule = "" }},
		{"explain.reissue", `must be "", "invalidated" or "at_risk"`, func(c *Config) { c.Explain.Reissue = "certified" }, func(c *Config) { c.Explain.Reissue = "at_risk" }},
		{"explain.timeout", "must be positive", func(c *Config) { c.Explain.Timeout = 0 }, func(c *Config) { c.Explain.Timeout = 1 }},
		{"explain.max_iterations", "must be positive", func(c *Config) { c.Explain.MaxIterations = 0 }, func(c *Config) { c.Explain.MaxIterations = 1 }},
		{"explain.concurrency", "must be 0 (one per core) or positive", func(c *Config) { c.Explain.Concurrency = -1 }, func(c *Config) { c.Explain.Concurrency = 0 }},
		{"update.kl_weight", "must be finite and >= 0", func(c *Config) { c.Update.KLWeight = math.NaN() }, nil},
		{"update.kl_weight", "must be finite and >= 0", func(c *Config) { c.Update.KLWeight = math.Inf(1) }, nil},
		{"certify.hoeffding_alpha", "must be in [0, 1)", func(c *Config) { c.Certify.HoeffdingAlpha = math.NaN() }, nil},
		{"kafka.client_id", "must be set", func(c *Config) { c.Kafka.ClientID = "" }, nil},
		{"explain.max_iterations", "must be at most 1000000", func(c *Config) { c.Explain.MaxIterations = MaxExplainIterations + 1 },
			func(c *Config) { c.Explain.MaxIterations = MaxExplainIterations }},
		{"explain.concurrency", "must be at most 256", func(c *Config) { c.Explain.Concurrency = MaxExplainConcurrency + 1 },
			func(c *Config) { c.Explain.Concurrency = MaxExplainConcurrency }},
		// Both bounds of the embedded broker's limits, each with its nearest good value: the
		// cases above refuse only values far from them (4 connections, 10ms, 0s).
		{"kafka.embedded_max_connections", "must be in [16, 1000000]", func(c *Config) { c.Kafka.EmbeddedMaxConnections = 15 },
			func(c *Config) { c.Kafka.EmbeddedMaxConnections = 16 }},
		{"kafka.embedded_max_connections", "must be in [16, 1000000]", func(c *Config) { c.Kafka.EmbeddedMaxConnections = 1_000_001 },
			func(c *Config) { c.Kafka.EmbeddedMaxConnections = 1_000_000 }},
		{"kafka.embedded_idle_timeout", "must be at least 1s", func(c *Config) { c.Kafka.EmbeddedIdleTimeout = time.Second - 1 },
			func(c *Config) { c.Kafka.EmbeddedIdleTimeout = time.Second }},
		{"kafka.embedded_request_timeout", "must be at least 1s", func(c *Config) { c.Kafka.EmbeddedRequestTimeout = time.Second - 1 },
			func(c *Config) { c.Kafka.EmbeddedRequestTimeout = time.Second }},
		// A space in a host is refused as a slash is (net.Dial would look the name up as given).
		{"kafka.brokers[0]", `must be host:port, got host "a b"`, func(c *Config) { c.Kafka.Brokers = []string{"a b:9092"} },
			func(c *Config) { c.Kafka.Brokers = []string{"a-b:9092"} }},
		// The converge solver's keys: update.solver, and the bounds of the keys only it reads.
		{"update.solver", "must be converge or adam", func(c *Config) { c.Update.Solver = "sgd" }, func(c *Config) { c.Update.Solver = "adam" }},
		{"update.memory_records", "must be >= 0", func(c *Config) { c.Update.MemoryRecords = -1 }, func(c *Config) { c.Update.MemoryRecords = 0 }},
		{"update.memory_records", "must be >= 0", func(c *Config) { c.Update.MemoryRecords = math.NaN() }, nil},
		{"update.memory_records", "must be >= 0", func(c *Config) { c.Update.MemoryRecords = math.Inf(1) }, func(c *Config) { c.Update.MemoryRecords = math.MaxFloat64 }},
		{"update.tolerance", "must be in (0, 1]", func(c *Config) { c.Update.Tolerance = 0 }, func(c *Config) { c.Update.Tolerance = math.SmallestNonzeroFloat64 }},
		{"update.tolerance", "must be in (0, 1]", func(c *Config) { c.Update.Tolerance = math.NaN() }, nil},
		{"update.tolerance", "must be in (0, 1]", func(c *Config) { c.Update.Tolerance = math.Nextafter(1, 2) }, func(c *Config) { c.Update.Tolerance = 1 }},
		{"update.max_iterations", "must be >= 1", func(c *Config) { c.Update.MaxIterations = 0 }, func(c *Config) { c.Update.MaxIterations = 1 }},
		{"update.max_iterations", "must be at most 100000", func(c *Config) { c.Update.MaxIterations = MaxUpdateIterations + 1 },
			func(c *Config) { c.Update.MaxIterations = MaxUpdateIterations }},
		{"update.draws", "must be >= 1", func(c *Config) { c.Update.Draws = 0 }, func(c *Config) { c.Update.Draws = 1 }},
		{"update.draws", "must be at most 1000", func(c *Config) { c.Update.Draws = MaxUpdateSamples + 1 }, func(c *Config) { c.Update.Draws = MaxUpdateSamples }},
	}
	checkKeyCases(t, Default, cases)
}

// keyCase breaks one key of a valid config (set) and names the key and what its one error says;
// edge, when the rule is a bound or a pairing, sets the nearest good value instead.
type keyCase struct {
	key, want string
	set, edge func(c *Config)
}

// checkKeyCases runs each case on a fresh base(): Validate must refuse it with one error, for
// its key, saying want, and accept the case's edge.
// certify.epsilon above 0.25 alone: the rule between it and certify.epsilon_max, at its
// default, says so and names the key to change.
func TestEpsilonAboveEpsilonMaxDefault(t *testing.T) {
	_, err := Load("certify:\n  epsilon: 0.3\n")
	want := "certify.epsilon_max: 0.25: must be in [certify.epsilon, 0.25]: certify.epsilon_max is at its default, 0.25, the most it may be; lower certify.epsilon (0.3)"
	if err == nil || !strings.Contains(err.Error(), "certify.epsilon (line 2): 0.3: must be within (0, 0.25]") || !strings.Contains(err.Error(), want) {
		t.Errorf("certify.epsilon 0.3: Load = %v, want %q", err, want)
	}
}

func checkKeyCases(t *testing.T, base func() Config, cases []keyCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.key+" "+tc.want, func(t *testing.T) {
			c := base()
			tc.set(&c)
			err := c.Validate()
			if err == nil || !errors.Is(err, ErrInvalid) {
				t.Fatalf("Validate = %v, want ErrInvalid", err)
			}
			lines := strings.Split(strings.TrimPrefix(err.Error(), ErrInvalid.Error()+": "), "\n")
			if len(lines) != 1 || !strings.HasPrefix(lines[0], tc.key+": ") || !strings.Contains(lines[0], tc.want) {
				t.Fatalf("Validate = %v\nwant one error, for key %s, saying %q", err, tc.key, tc.want)
			}
			if tc.edge != nil {
				c := base()
				tc.edge(&c)
				if err := c.Validate(); err != nil {
					t.Fatalf("the nearest good value is refused: %v", err)
				}
			}
		})
	}
}

// The replicas of the README's "Scaling out" are valid, distinct, and point at the brokers
// `cfguard broker --nodes 3` serves by default.
func TestScalingOutExamples(t *testing.T) {
	// The examples name ./cluster.key, which the README makes with cfguard gen-key.
	t.Setenv("CFGUARD_REPLICATION_KEY_FILE", writeKeyFile(t, t.TempDir()))
	seen := map[string]bool{}
	for _, name := range []string{"r1", "r2", "r3"} {
		c, err := LoadFile(filepath.Join("..", "examples", "replicas", name+".yaml"))
		if err != nil {
			t.Fatal(err)
		}
		if !c.Replication.Enabled || c.Replication.ReplicaID != name {
			t.Errorf("%s: replication %+v", name, c.Replication)
		}
		if strings.Join(c.Kafka.Brokers, ",") != "127.0.0.1:9092,127.0.0.1:9093,127.0.0.1:9094" {
			t.Errorf("%s: kafka.brokers %v", name, c.Kafka.Brokers)
		}
		for _, v := range []string{c.HTTP.Listen, c.StateDir} {
			if seen[v] {
				t.Errorf("%s: %s shared with another replica", name, v)
			}
			seen[v] = true
		}
	}
}

// withoutLines is err's text without the lines its keys are named with (" (line N)"), for the
// tests of what each error says; TestValidationErrorsNameTheLine tests the lines.
func withoutLines(err error) string {
	return regexp.MustCompile(` \(line \d+\)`).ReplaceAllString(err.Error(), "")
}

// An error of validation (a value that decodes but breaks a rule) names the line of its key,
// as a decoding error does; an item of a list by its own line.
func TestValidationErrorsNameTheLine(t *testing.T) {
	for _, tc := range []struct{ text, want string }{
		{"update:\n  objective: \"\"\n", `update.objective (line 2): : must be prior or vcl`},
		{"http:\n  listen: 127.0.0.1:1\n  max_body_bytes: -1\n", "http.max_body_bytes (line 3): -1: must be positive"},
		{"kafka:\n  brokers: [127.0.0.1:9092]\nreplication:\n  enabled: true\n  skip_ce_requests:\n    - {partition: 0, offset: 3}\n    - {partition: 99, offset: 1}\n",
			"replication.skip_ce_requests[1] (line 7): partition 99"},
	} {
		_, err := Load(tc.text)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: Load = %v, want %q", tc.text, err, tc.want)
		}
	}
	// Validate alone (a Config built in code) names no line.
	c := Default()
	c.Update.Objective = ""
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "update.objective: : must be prior or vcl") {
		t.Errorf("Validate of a Config built in code: %v", err)
	}
}

// TestTokensNoClientCouldSend: a token that an HTTP header cannot carry (a newline a Secret's
// file kept, a control character, spaces at its ends) is refused, from the file and from the
// environment, naming where it came from and never printing it.
func TestTokensNoClientCouldSend(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	for name, tc := range map[string]struct{ file, env, value, want string }{
		"file newline":       {file: "http:\n  token: |\n    s3cret-abc\n", value: "s3cret-abc", want: "http.token (line 2): holds a newline at its end"},
		"file metrics space": {file: "http:\n  metrics_token: \"s3cret-abc\\t\"\n", value: "s3cret-abc", want: "http.metrics_token (line 2): ends with a space or a tab"},
		"env newline":        {env: "CFGUARD_HTTP_TOKEN", value: "s3cret-abc\n", want: "CFGUARD_HTTP_TOKEN: holds a newline at its end"},
		"env control":        {env: "CFGUARD_HTTP_METRICS_TOKEN", value: "s3cret\x01abc", want: "CFGUARD_HTTP_METRICS_TOKEN: holds a control character (U+0001) at byte 6"},
		"env trailing space": {env: "CFGUARD_HTTP_TOKEN", value: "s3cret-abc ", want: "CFGUARD_HTTP_TOKEN: ends with a space or a tab"},
		"env DEL":            {env: "CFGUARD_HTTP_TOKEN", value: "s3cret\x7fabc", want: "CFGUARD_HTTP_TOKEN: holds a control character (U+007F) at byte 6"},
		"env inner newline":  {env: "CFGUARD_HTTP_TOKEN", value: "s3cret\nabc", want: "CFGUARD_HTTP_TOKEN: holds a control character (U+000A) at byte 6"},
	} {
		t.Run(name, func(t *testing.T) {
			if tc.env != "" {
				t.Setenv(tc.env, tc.value)
			}
			if err := os.WriteFile(p, []byte(tc.file), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := LoadFile(p)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "s3cret") {
				t.Fatalf("got %v, want ErrInvalid saying %q without the token", err, tc.want)
			}
		})
	}
	// Tokens a client can send: inner spaces and tabs and leading spaces reach the server as
	// they were sent.
	t.Setenv("CFGUARD_HTTP_TOKEN", " a token\twith inner spaces")
	if err := os.WriteFile(p, []byte("http:\n  metrics_token: \"m/+=~._-\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if c, err := LoadFile(p); err != nil || c.HTTP.Token != " a token\twith inner spaces" || c.HTTP.MetricsToken != "m/+=~._-" {
		t.Fatalf("tokens a client can send: %v", err)
	}
}

// TestStepOfThePriorObjectiveDividesByTheRecordsRepresented: the prior objective divides its KL
// by N_t = exp(-n / M) N_{t-1} + n (docs/MATHS.md, "The records a posterior stands for"), with
// N_{t-1} stated as M (or UnknownRecords without a memory) for a posterior that records none;
// the streaming objective takes no such count.
func TestStepOfThePriorObjectiveDividesByTheRecordsRepresented(t *testing.T) {
	const n = 64
	for _, c := range []struct {
		name            string
		objective       string
		memory, records float64
		want            float64
	}{
		{"prior, memory 50,000", update.ObjectivePrior, 50000, 1000, math.Exp(-n/50000.0)*1000 + n},
		{"prior, no memory", update.ObjectivePrior, 0, 1000, 1000 + n},
		{"prior, records not stated, memory", update.ObjectivePrior, 2000, 0, math.Exp(-n/2000.0)*2000 + n},
		{"prior, records not stated, no memory", update.ObjectivePrior, 0, 0, UnknownRecords + n},
		{"vcl takes no count", update.ObjectiveVCL, 50000, 1000, 0},
	} {
		u := Default().Update
		u.Objective, u.MemoryRecords = c.objective, c.memory
		_, cfg := u.Step(&bnn.Model{Records: c.records}, n, 1)
		if math.Abs(cfg.Represented-c.want) > 1e-9*max(1, c.want) {
			t.Errorf("%s: Represented %v, want %v", c.name, cfg.Represented, c.want)
		}
	}
}

// TestValidateReplicationRejectsEachKey: TestValidateRejectsEachKey for the replication keys,
// which are checked only on a replica: each case starts from a valid replica (the defaults with
// kafka.brokers and replication.enabled), breaks one key, wants one error naming it, and accepts
// the nearest good value (edge, when the rule is a bound or a pairing).
func TestValidateReplicationRejectsEachKey(t *testing.T) {
	replica := func() Config {
		c := Default()
		c.Kafka.Brokers = []string{"kafka.example:9092"}
		c.Replication.Enabled = true
		return c
	}
	// http.write_timeout defaults to 2m, RegisterSendMargin is 15s: a wait must end before 1m45s.
	const lastWait = 105*time.Second - 1
	skip := func(q CERequest) func(c *Config) {
		return func(c *Config) { c.Replication.SkipCERequests = CERequests{q} }
	}
	cases := []keyCase{
		{"replication.ce_topic", "must differ from kafka.topic", func(c *Config) { c.Replication.CETopic = c.Kafka.Topic }, nil},
		{"replication.ce_topic", "must differ from kafka.dead_letter_topic", func(c *Config) { c.Replication.CETopic = c.Kafka.DeadLetterTopic }, nil},
		{"replication.ce_partitions", "must be in [1, 1024]", func(c *Config) { c.Replication.CEPartitions = 1025 }, func(c *Config) { c.Replication.CEPartitions = 1024 }},
		{"replication.advertise_url", "must be an http:// or https:// URL with a host", func(c *Config) { c.Replication.AdvertiseURL = "http://" },
			func(c *Config) { c.Replication.AdvertiseURL = "http://h" }},
		{"replication.advertise_url", "must be an http:// or https:// URL with a host", func(c *Config) { c.Replication.AdvertiseURL = "ftp://h:8080" },
			func(c *Config) { c.Replication.AdvertiseURL = "https://h:8080" }},
		{"replication.replica_id", "must be at most 128 characters", func(c *Config) { c.Replication.ReplicaID = strings.Repeat("r", 129) },
			func(c *Config) { c.Replication.ReplicaID = strings.Repeat("r", 128) }},
		{"replication.replica_id", "without spaces or '/'", func(c *Config) { c.Replication.ReplicaID = "r 1" }, func(c *Config) { c.Replication.ReplicaID = "r-1" }},
		{"replication.replica_id", "without spaces or '/'", func(c *Config) { c.Replication.ReplicaID = "r\t1" }, nil},
		{"replication.session_timeout", "must be in [1s, 5m]", func(c *Config) { c.Replication.SessionTimeout = 5*time.Minute + 1 },
			func(c *Config) { c.Replication.SessionTimeout = 5 * time.Minute }},
		{"replication.register_wait", "more than 15s below http.write_timeout", func(c *Config) { c.Replication.RegisterWait = lastWait + 1 },
			func(c *Config) { c.Replication.RegisterWait = lastWait }},
		{"replication.register_wait", "must be 0 or more", func(c *Config) { c.Replication.RegisterWait = -1 }, func(c *Config) { c.Replication.RegisterWait = 0 }},
		// The largest durations: wait + margin would overflow to a negative sum, below any timeout.
		{"replication.register_wait", "more than 15s below http.write_timeout", func(c *Config) { c.Replication.RegisterWait = math.MaxInt64 },
			nil},
		{"replication.register_wait", "more than 15s below http.write_timeout", func(c *Config) { c.Replication.RegisterWait = math.MaxInt64 - 10*time.Second },
			nil},
		{"replication.peer_tls.cert_file", "cert_file and key_file go together", func(c *Config) { c.Replication.PeerTLS.KeyFile = "k.pem" },
			func(c *Config) { c.Replication.PeerTLS.CertFile, c.Replication.PeerTLS.KeyFile = "c.pem", "k.pem" }},
		// skip_ce_requests built in code (Load's decoding checks some of this already).
		{"replication.skip_ce_requests[0]", "needs a partition in [0, 12)", skip(CERequest{Partition: -1, Offset: 1}), skip(CERequest{Partition: 0, Offset: 1})},
		{"replication.skip_ce_requests[0]", "through is the last offset of the range: at least offset", skip(CERequest{Offset: 5, Through: 4}),
			skip(CERequest{Offset: 5, Through: 5})},
		// An id with through equal to offset names one request, as offset alone does.
		{"replication.skip_ce_requests[0]", "an id names one request", skip(CERequest{Offset: 5, Through: 6, ID: "ce-1"}),
			skip(CERequest{Offset: 5, Through: 5, ID: "ce-1"})},
	}
	checkKeyCases(t, replica, cases)
}

// TestSkipCERequestThroughItsOffset: a range whose through is its offset (one request, written
// as a range) loads as written.
func TestSkipCERequestThroughItsOffset(t *testing.T) {
	c, err := Load("kafka:\n  brokers: [127.0.0.1:9092]\nreplication:\n  enabled: true\n  skip_ce_requests: [{partition: 2, offset: 7, through: 7}]\n")
	if err != nil || !slices.Equal(c.Replication.SkipCERequests, CERequests{{Partition: 2, Offset: 7, Through: 7}}) {
		t.Fatalf("Load = %v, %+v; want the one request at offset 7 of partition 2", err, c)
	}
}

// TestSecretsFromTheEnvironment: CFGUARD_KAFKA_SASL_PASSWORD and CFGUARD_HTTP_METRICS_TOKEN
// override the file (a Kubernetes Secret holds them, not the configuration).
func TestSecretsFromTheEnvironment(t *testing.T) {
	t.Setenv("CFGUARD_KAFKA_SASL_PASSWORD", "pw-from-env")
	t.Setenv("CFGUARD_HTTP_METRICS_TOKEN", "metrics-from-env")
	c, err := LoadFile("testdata/good.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.Kafka.SASL.Password != "pw-from-env" || c.HTTP.MetricsToken != "metrics-from-env" {
		t.Fatalf("kafka.sasl.password %q, http.metrics_token %q; want the environment's", c.Kafka.SASL.Password, c.HTTP.MetricsToken)
	}
}

// TestSASLPasswordFromTheEnvironmentNeedsAMechanism: CFGUARD_KAFKA_SASL_PASSWORD without
// kafka.sasl.mechanism would not be used, so LoadFile refuses it, naming the variable and the
// keys to set, without printing the password.
func TestSASLPasswordFromTheEnvironmentNeedsAMechanism(t *testing.T) {
	t.Setenv("CFGUARD_KAFKA_SASL_PASSWORD", "pw-from-env")
	p := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(p, []byte("kafka:\n  brokers: [k.example:9092]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := LoadFile(p)
	want := "CFGUARD_KAFKA_SASL_PASSWORD: <redacted>: is set but kafka.sasl.mechanism is empty, so the connection to Kafka would not authenticate"
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "pw-from-env") {
		t.Fatalf("LoadFile = %v, want ErrInvalid saying %q, without the password", err, want)
	}
}

// TestYAMLRedactsEverySecret: the printed configuration (check-config, GET /v1/config) shows
// "<redacted>" for each secret that is set, the metrics token and the SASL password included.
func TestYAMLRedactsEverySecret(t *testing.T) {
	c := Default()
	c.HTTP.Token, c.HTTP.MetricsToken, c.Kafka.SASL.Password = "api-secret", "metrics-secret", "sasl-secret"
	out, err := c.YAML()
	if err != nil {
		t.Fatal(err)
	}
	for _, secret := range []string{"api-secret", "metrics-secret", "sasl-secret"} {
		if strings.Contains(string(out), secret) {
			t.Errorf("the printed configuration shows %q:\n%s", secret, out)
		}
	}
	if n := strings.Count(string(out), "<redacted>"); n != 3 {
		t.Errorf("%d secrets redacted, want 3:\n%s", n, out)
	}
}

// TestExportDirDefault: model.export_dir empty is <state_dir>/export.
func TestExportDirDefault(t *testing.T) {
	c := Default()
	if got := c.ExportDir(); got != "state/export" {
		t.Errorf("default ExportDir %q, want state/export", got)
	}
	c.StateDir, c.Model.ExportDir = "/var/lib/cfguard", ""
	if got := c.ExportDir(); got != "/var/lib/cfguard/export" {
		t.Errorf("ExportDir %q, want /var/lib/cfguard/export", got)
	}
	c.Model.ExportDir = "/srv/models"
	if got := c.ExportDir(); got != "/srv/models" {
		t.Errorf("ExportDir %q, want the key's value", got)
	}
}

// TestServesTLS: the web configuration serves TLS when its tls_server_config names a certificate,
// as a file (cert_file) or inline (cert); the default advertise URL is then https://.
func TestServesTLS(t *testing.T) {
	dir := t.TempDir()
	for name, tc := range map[string]struct {
		text string
		want bool
	}{
		"cert_file":  {"tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n", true},
		"inline":     {"tls_server_config:\n  cert: \"-----BEGIN CERTIFICATE-----\"\n  key: k\n", true},
		"basic auth": {"basic_auth_users:\n  ops: x\n", false},
	} {
		p := filepath.Join(dir, name+".yml")
		if err := os.WriteFile(p, []byte(tc.text), 0o600); err != nil {
			t.Fatal(err)
		}
		c := Default()
		c.HTTP.WebConfigFile = p
		if got := c.ServesTLS(); got != tc.want {
			t.Errorf("%s: ServesTLS = %v, want %v", name, got, tc.want)
		}
	}
	if c := Default(); c.ServesTLS() {
		t.Error("no web configuration: ServesTLS = true")
	}
}

// TestTabAfterSpaces: a tab anywhere in a line's indentation, after spaces too, is refused with
// the plain message naming the file and line.
func TestTabAfterSpaces(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(p, []byte("kafka:\n  \ttopic: x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadFile(p); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), p+":2: indentation uses a tab; YAML needs spaces") {
		t.Fatalf("LoadFile = %v, want the tab on line 2 named", err)
	}
}
