package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
		"not a mapping":      {"- a\n- b\n", "cannot unmarshal"},
		"learning rate zero": {"update:\n  learning_rate: 0\n", "update.learning_rate"},
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
