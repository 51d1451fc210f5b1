package command_test

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/cli/clitest"
	"github.com/cfguard/cfguard/internal/tooltest"
)

func TestBoundReproducesPaperRow(t *testing.T) {
	code, out, errs := proc.RunCLI(t, "bound", "--p1", "0.9977", "--kl", "0.000330", "--var1", "0.001")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var r struct {
		P2Lower, Var2Upper, KLMax float64
	}
	dec := json.NewDecoder(strings.NewReader(strings.NewReplacer("p2_lower", "P2Lower", "var2_upper", "Var2Upper", `"kl_max"`, `"KLMax"`).Replace(out)))
	if err := dec.Decode(&r); err != nil {
		t.Fatal(err)
	}
	if r.P2Lower < 0.97195 || r.P2Lower > 0.97205 || r.KLMax != 0.10125 || r.Var2Upper <= 0.001 {
		t.Fatalf("bound output %s", out)
	}
}

// TestUsageErrorsExit2: a usage error exits 2, and where its message is given, says it.
func TestUsageErrorsExit2(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // in stderr; "" checks the exit code only
	}{
		{nil, ""},
		{[]string{"frobnicate"}, ""},
		{[]string{"bound", "--p1", "1.5", "--kl", "0"}, "--p1 must be in [0, 1], got 1.5"},
		{[]string{"bound", "--p1", "0.9", "--kl", "-1"}, ""},
		{[]string{"bound", "--p1", "0.9", "--kl", "0.1", "--mode", "loose"}, ""},
		{[]string{"bound", "--kl", "0.1"}, "--p1 and --kl are required"},
		{[]string{"bound", "--p1", "0.9"}, "--p1 and --kl are required"},
		{[]string{"bound", "--p1", "0.9", "--kl", "NaN"}, "--kl must be a finite number >= 0, got NaN"},
		{[]string{"bound", "--p1", "NaN", "--kl", "0.1"}, "--p1 must be in [0, 1], got NaN"},
		{[]string{"bound", "--p1", "0.9", "--kl", "0.1", "--var1", "NaN"}, "--var1 must be in [0, 0.25], got NaN"},
		{[]string{"broker", "--nodes", "65"}, "--nodes 65: want 1..64"},
		{[]string{"broker", "--partitions", "3"}, "--partitions 3 applies to the topics --topics creates: give --topics too"},
		{[]string{"broker", "--metrics-listen", "bogus"}, `--metrics-listen "bogus": must be host:port (address bogus: missing port in address), such as 127.0.0.1:9644`},
		{[]string{"broker", "--metrics-listen", "127.0.0.1:99999"}, `--metrics-listen "127.0.0.1:99999"`},
		{[]string{"new-epoch", "--config", "cfguard.yaml", "--wait", "5s"}, "give --head-from too, or drop --wait"},
		{[]string{"verify-log", "--config", "cfguard.yaml", "--from", "5", "--to", "2"}, "--from 5 is past --to 2"},
		{[]string{"kl", "--old", "x"}, ""},
		{[]string{"train", "--data", "nope.csv", "--out", "x", "--holdout", "2"}, ""},
		{[]string{"train", "--data", "nope.csv", "--out", "x", "--holdout", "1"}, ""},
		{[]string{"train", "--data", "nope.csv", "--out", "x", "--holdout", "-0.1"}, ""},
		{[]string{"experiment", "psce"}, ""}, // moved to cfguard-lab
	} {
		code, _, stderr := proc.RunCLI(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, %q; want 2, saying %q", tc.args, code, stderr, tc.want)
		}
	}
}

func TestTrainThenKL(t *testing.T) {
	if testing.Short() {
		t.Skip("trains two models")
	}
	dir := t.TempDir()
	// --holdout 0 trains on every row and reports no test accuracy.
	code, stdout, stderr := proc.RunCLI(t, "train", "--data", "breast_cancer", "--out", filepath.Join(dir, "all"), "--holdout", "0", "--epochs", "1")
	var all struct {
		Rows         int
		TestAccuracy *float64 `json:"test_accuracy"`
	}
	if err := json.Unmarshal([]byte(stdout), &all); err != nil || code != 0 || all.TestAccuracy != nil || all.Rows == 0 {
		t.Fatalf("train --holdout 0: exit %d, %q (%v): %s", code, stdout, err, stderr)
	}
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for i, out := range []string{a, b} {
		code, stdout, stderr := proc.RunCLI(t, "train", "--data", "breast_cancer", "--out", out, "--seed", []string{"1", "2"}[i], "--epochs", "5")
		if code != 0 {
			t.Fatalf("train exit %d: %s", code, stderr)
		}
		if !strings.Contains(stdout, "test_accuracy") || !strings.Contains(stderr, "epoch=5") {
			t.Fatalf("train output lacks accuracy or progress: %s / %s", stdout, stderr)
		}
		// The default holdout keeps a fifth of the rows out of training and scores the model on
		// them: on this data set, well above chance.
		var r struct {
			Rows         int
			TestRows     int     `json:"test_rows"`
			TestAccuracy float64 `json:"test_accuracy"`
		}
		if err := json.Unmarshal([]byte(stdout), &r); err != nil {
			t.Fatal(err)
		}
		if r.Rows+r.TestRows != all.Rows || math.Abs(float64(r.TestRows)-0.2*float64(all.Rows)) > 1 || !(r.TestAccuracy > 0.8) {
			t.Fatalf("train: %d rows, %d test rows, test accuracy %v; want %d rows in all, a fifth held out, accuracy over 0.8", r.Rows, r.TestRows, r.TestAccuracy, all.Rows)
		}
	}
	// A second train into a model directory leaves it as it is.
	before, _ := os.ReadFile(filepath.Join(a, "model.safetensors"))
	if code, _, errs := proc.RunCLI(t, "train", "--data", "german_credit", "--out", a, "--epochs", "1"); code != 2 || !strings.Contains(errs, "--out "+a+" already holds") {
		t.Fatalf("train into a model directory: exit %d, %s", code, errs)
	}
	if after, _ := os.ReadFile(filepath.Join(a, "model.safetensors")); !bytes.Equal(before, after) {
		t.Fatal("train replaced a model directory's weights")
	}
	code, out, errs := proc.RunCLI(t, "kl", "--old", a, "--new", a)
	if code != 0 || !strings.HasPrefix(out, `{"direction":"KL(new || old)","kl":0,"params":4130`) {
		t.Fatalf("kl of a model with itself: %d %s %s", code, out, errs)
	}
	code, out, _ = proc.RunCLI(t, "kl", "--old", a, "--new", b)
	var r struct{ KL float64 }
	json.Unmarshal([]byte(out), &r)
	if code != 0 || !(r.KL > 0) {
		t.Fatalf("kl between different models: %d %s", code, out)
	}
	// A truncated model file is refused with a clear error.
	w := filepath.Join(b, "model.safetensors")
	raw, _ := os.ReadFile(w)
	os.WriteFile(w, raw[:len(raw)/3], 0o644)
	code, _, errs = proc.RunCLI(t, "kl", "--old", a, "--new", b)
	if code != 1 || !strings.Contains(errs, "truncated") || !strings.Contains(errs, "--new: load model "+b) {
		t.Fatalf("truncated model: exit %d, %s", code, errs)
	}
}

// A negative --epochs, and a --holdout that leaves no row to train or to test on, are usage
// errors naming the flag, refused before any training.
func TestTrainRefusesEpochsAndHoldoutThatCannotWork(t *testing.T) {
	dir := t.TempDir()
	tiny := filepath.Join(dir, "tiny.csv")
	if err := os.WriteFile(tiny, []byte("a,b,label\n1,2,0\n3,4,1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--data", "breast_cancer", "--epochs", "-1"}, "--epochs must be >= 0"},
		{[]string{"--data", tiny}, "--holdout 0.2 of the 2 rows of " + tiny + " leaves 2 to train on and 0 to test on"},
		{[]string{"--data", tiny, "--holdout", "0.9"}, "leaves 0 to train on and 2 to test on"},
	} {
		out := filepath.Join(dir, "m")
		code, _, errs := proc.RunCLI(t, append([]string{"train", "--out", out}, tc.args...)...)
		if code != 2 || !strings.Contains(errs, tc.want) {
			t.Errorf("%v: exit %d, %s; want 2 saying %q", tc.args, code, errs, tc.want)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("%v: wrote %s", tc.args, out)
		}
	}
}

func TestTrainRejectsBadCSV(t *testing.T) {
	dir := t.TempDir()
	for name, text := range map[string]string{
		"shape": "a,b,label\n1,2,0\n1,0\n",
		"nan":   "a,b,label\n1,2,1\n1,NaN,0\n",
		"label": "a,b,label\n1,2,0\n1,2,x\n",
		"huge":  "a,b,label\n1,2,0\n1,2,2000000000\n",
	} {
		p := filepath.Join(dir, name+".csv")
		os.WriteFile(p, []byte(text), 0o644)
		code, _, errs := proc.RunCLI(t, "train", "--data", p, "--out", filepath.Join(dir, "m"))
		if code != 1 || !strings.Contains(errs, "line 3") || (name == "nan" && !strings.Contains(errs, `column "b"`)) {
			t.Errorf("%s: exit %d, %s", name, code, errs)
		}
	}
}

func TestRunRejectsBadConfigWithExit2(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(p, []byte("certify:\n  delta: 0.7\n"), 0o644)
	code, _, errs := proc.RunCLI(t, "run", "--config", p)
	if code != 2 || !strings.Contains(errs, "certify.delta (line 2): 0.7") {
		t.Fatalf("exit %d: %s", code, errs)
	}
}

func TestCheckConfig(t *testing.T) {
	code, out, errs := proc.RunCLI(t, "check-config", "--config", filepath.Join(tooltest.RepoRoot(t), "config.yaml"))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, want := range []string{"is valid", "max_wait: 5s", "topic: cfguard.records", "delta: 0.05", "model.export_dir resolves to " + filepath.Join("state", "export")} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(bad, []byte("audit:\n  schedule: \"@every -1s\"\n"), 0o644)
	if code, _, errs := proc.RunCLI(t, "check-config", "--config", bad); code != 2 || !strings.Contains(errs, "audit.schedule") {
		t.Fatalf("invalid config: exit %d, stderr %q; want 2 naming audit.schedule", code, errs)
	}
	// A model cut short: check-config and run load it and refuse it by its key (exit 2);
	// commands that do not need the model load the configuration.
	dir := t.TempDir()
	model := filepath.Join(dir, "model")
	if err := bnn.Save(model, bnn.New(3, []int{4}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(1, 2)))); err != nil {
		t.Fatal(err)
	}
	w := filepath.Join(model, bnn.WeightsFile)
	raw, _ := os.ReadFile(w)
	os.WriteFile(w, raw[:len(raw)/2], 0o644)
	cut := filepath.Join(dir, "cut.yaml")
	os.WriteFile(cut, []byte("state_dir: "+filepath.Join(dir, "state")+"\nmodel:\n  path: "+model+"\n"), 0o644)
	for _, cmd := range []string{"check-config", "run"} {
		if code, _, errs := proc.RunCLI(t, cmd, "--config", cut); code != 2 || !strings.Contains(errs, "model.path: load model "+model) {
			t.Errorf("%s with a model cut short: exit %d, stderr %q; want 2 naming model.path", cmd, code, errs)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "state")); !os.IsNotExist(err) {
		t.Errorf("run with a model cut short left a state directory: %v", err)
	}
}

// The broker command's --listen and --metrics-listen refuse the addresses http.listen refuses,
// for the same reason in the same words (config.CheckListenAddr), naming the flag (exit 2). A
// --listen port that is not a number would have node 0 listen on a port no flag names. The
// context is cancelled, so that a broker started on an address taken in error stops at once.
func TestBrokerListenFlagsRefuseWhatHTTPListenRefuses(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, addr := range []string{"bogus", "127.0.0.1:abc", "127.0.0.1:http", "127.0.0.1:99999", "localhost:-1", "127.0.0.1:"} {
		_, err := config.Load("http:\n  listen: " + strconv.Quote(addr) + "\n")
		if err == nil {
			t.Fatalf("http.listen %q is accepted", addr)
		}
		first, _, _ := strings.Cut(err.Error(), "\n")
		_, why, ok := strings.Cut(first, "http.listen (line 2): "+addr+": ")
		if !ok {
			t.Fatalf("http.listen %q: %v, want an error naming the key and the address", addr, err)
		}
		for _, flag := range []string{"--listen", "--metrics-listen"} {
			var stdout, stderr bytes.Buffer
			code := command.Run(ctx, []string{"broker", "--listen", "127.0.0.1:0", flag, addr}, &stdout, &stderr)
			if want := fmt.Sprintf("%s %q: %s, such as ", flag, addr, why); code != 2 || !strings.Contains(stderr.String(), want) {
				t.Errorf("broker %s %q: exit %d, stderr %q; want 2 saying %q", flag, addr, code, stderr.String(), want)
			}
		}
	}
}

// SASL credentials without kafka.sasl.mechanism would not be used: check-config refuses them
// (exit 2), in the file or the environment, naming each key or variable and how to fix it, and
// does not print the password.
func TestCheckConfigRefusesSASLCredentialsWithoutAMechanism(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file.yaml")
	if err := os.WriteFile(file, []byte("kafka:\n  brokers: [k.example:9092]\n  sasl:\n    username: svc\n    password: pw-in-file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := filepath.Join(dir, "env.yaml")
	if err := os.WriteFile(env, []byte("kafka:\n  brokers: [k.example:9092]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CFGUARD_KAFKA_SASL_PASSWORD", "pw-from-env")
	for _, c := range []struct {
		path string
		want []string
	}{
		{file, []string{
			"kafka.sasl.username (line 4): svc: is set but kafka.sasl.mechanism is empty, so the connection to Kafka would not authenticate: " +
				"set kafka.sasl.mechanism (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512), or remove the key",
			"kafka.sasl.password (line 5): <redacted>: is set but kafka.sasl.mechanism is empty",
		}},
		{env, []string{"CFGUARD_KAFKA_SASL_PASSWORD: <redacted>: is set but kafka.sasl.mechanism is empty, so the connection to Kafka would not authenticate: " +
			"set kafka.sasl.mechanism (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512) and kafka.sasl.username in " + env + ", or unset the variable"}},
	} {
		code, _, errs := proc.RunCLI(t, "check-config", "--config", c.path)
		for _, want := range c.want {
			if code != 2 || !strings.Contains(errs, want) {
				t.Errorf("check-config %s: exit %d, stderr %q; want 2 saying %q", filepath.Base(c.path), code, errs, want)
			}
		}
		if strings.Contains(errs, "pw-") {
			t.Errorf("check-config %s printed the password: %s", filepath.Base(c.path), errs)
		}
	}
}

func TestVersion(t *testing.T) {
	code, out, errs := proc.RunCLI(t, "version", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var v struct{ Module, Version, Go string }
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatal(err)
	}
	if v.Module != "github.com/cfguard/cfguard" || !strings.HasPrefix(v.Go, "go1.") || v.Version == "" {
		t.Fatalf("version %+v", v)
	}
	// Without --json: lines for people. A test binary carries no VCS stamp, and the commit line
	// says so rather than stay empty.
	code, out, errs = proc.RunCLI(t, "version")
	if code != 0 || !strings.HasPrefix(out, "cfguard "+v.Version+"\n  module github.com/cfguard/cfguard\n") ||
		!strings.Contains(out, "\n  commit unknown (not built from a VCS checkout)\n") || !strings.Contains(out, "\n  "+v.Go+" ") {
		t.Fatalf("version: exit %d, %q, %s", code, out, errs)
	}
}

// With log.format json, cfguard run logs JSON lines on stderr from its first line on.
func TestRunLogsJSON(t *testing.T) {
	dir := t.TempDir()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	// http.listen is taken, so that run stops once it has logged its start.
	p := filepath.Join(dir, "c.yaml")
	if err := os.WriteFile(p, []byte("state_dir: "+filepath.Join(dir, "state")+"\nhttp:\n  listen: "+busy.Addr().String()+
		"\nkafka:\n  embedded_listen: 127.0.0.1:0\nlog:\n  format: json\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, _, errs := proc.RunCLI(t, "run", "--config", p)
	first, _, _ := strings.Cut(errs, "\n")
	var line struct{ Msg, Config string }
	if code == 0 || json.Unmarshal([]byte(first), &line) != nil || line.Msg != "cfguard starting" || line.Config != p {
		t.Fatalf("run with log.format json: exit %d, stderr %q; want a JSON line saying cfguard starting first", code, errs)
	}
}

// The API and the embedded broker on one address: check-config and run refuse the file (exit 2)
// naming both keys, before run binds anything or creates state_dir. An address that is busy
// when run binds it is named by its key.
func TestOnePortForTheAPIAndTheBrokerIsRefused(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	p := filepath.Join(dir, "c.yaml")
	if err := os.WriteFile(p, []byte("state_dir: "+state+"\nhttp:\n  listen: 127.0.0.1:9092\nkafka:\n  embedded_listen: 127.0.0.1:9092\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"check-config", "run"} {
		code, _, errs := proc.RunCLI(t, cmd, "--config", p)
		if code != 2 || !strings.Contains(errs, "http.listen (line 3): 127.0.0.1:9092: is the address of kafka.embedded_listen (127.0.0.1:9092)") {
			t.Errorf("%s with http.listen = kafka.embedded_listen: exit %d, stderr %q; want 2 naming both keys", cmd, code, errs)
		}
	}
	if _, err := os.Stat(state); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("state_dir after the refused run: %v, want it not created", err)
	}

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	if err := os.WriteFile(p, []byte("state_dir: "+state+"\nhttp:\n  listen: "+busy.Addr().String()+"\nkafka:\n  embedded_listen: 127.0.0.1:0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, _, errs := proc.RunCLI(t, "run", "--config", p)
	if code == 0 || !strings.Contains(errs, "http.listen "+busy.Addr().String()+": listen tcp") || !strings.Contains(errs, "address already in use") {
		t.Fatalf("run with http.listen busy: exit %d, stderr %q; want an error naming http.listen and its address", code, errs)
	}
}

// check-config and run refuse replication without a readable cluster key file, naming
// replication.key_file and how to make one; gen-key makes one that check-config accepts.
func TestReplicationKeyFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "replica.yaml")
	const replica = "kafka:\n  brokers: [127.0.0.1:9]\nreplication:\n  enabled: true\n"
	if err := os.WriteFile(p, []byte(replica), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"check-config", "run"} {
		code, _, errs := proc.RunCLI(t, cmd, "--config", p)
		if code != 2 || !strings.Contains(errs, "replication.key_file") || !strings.Contains(errs, "cfguard gen-key") {
			t.Errorf("%s without a key file: exit %d, stderr %q; want 2 naming replication.key_file and cfguard gen-key", cmd, code, errs)
		}
	}
	code, key, errs := proc.RunCLI(t, "gen-key", "--id", "k2")
	if code != 0 || !strings.HasPrefix(key, "k2:") || len(strings.TrimSpace(key)) != len("k2:")+64 {
		t.Fatalf("gen-key: exit %d, %q, %s", code, key, errs)
	}
	kf := filepath.Join(dir, "cluster.key")
	if err := os.WriteFile(kf, []byte(key), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(replica+"  key_file: "+kf+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, _, errs := proc.RunCLI(t, "check-config", "--config", p); code != 0 {
		t.Errorf("check-config with gen-key's key: exit %d: %s", code, errs)
	}
}

// The overview (cfguard --help) and docs/CLI.md's synopsis name every flag of every command, as
// the command's own -h lists them, and no command, flag or default the binary does not have.
func TestOverviewAndCLIDocNameEveryFlag(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(tooltest.RepoRoot(t), "docs", "CLI.md"))
	if err != nil {
		t.Fatal(err)
	}
	clitest.CheckSynopsis(t, command.Program(), doc, "docs/CLI.md")
}

// cfguard kl prints KL(new || old): the divergence of --new's posterior from --old's, which is
// not symmetric when the two differ in their sigmas.
func TestKLDirection(t *testing.T) {
	dir := t.TempDir()
	oldM := bnn.New(3, []int{4}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	newM := bnn.New(3, []int{4}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(3, 4)))
	for i := range newM.Layers[0].WeightLogSigma {
		newM.Layers[0].WeightLogSigma[i] = math.Log(0.3)
	}
	oldDir, newDir := filepath.Join(dir, "old"), filepath.Join(dir, "new")
	for p, m := range map[string]*bnn.Model{oldDir: oldM, newDir: newM} {
		if err := bnn.Save(p, m); err != nil {
			t.Fatal(err)
		}
	}
	want, _, err := certify.KL(newM, oldM)
	if err != nil {
		t.Fatal(err)
	}
	back, _, err := certify.KL(oldM, newM)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(want-back) < 1e-6*want {
		t.Fatalf("KL(new || old) %v and KL(old || new) %v agree: the check cannot tell the directions apart", want, back)
	}
	code, out, errs := proc.RunCLI(t, "kl", "--old", oldDir, "--new", newDir)
	var r struct{ KL float64 }
	if err := json.Unmarshal([]byte(out), &r); err != nil || code != 0 {
		t.Fatalf("kl: exit %d, %q (%v): %s", code, out, err, errs)
	}
	if math.Abs(r.KL-want) > 1e-9*want {
		t.Fatalf("kl printed %v, want KL(new || old) = %v (KL(old || new) is %v)", r.KL, want, back)
	}
}

// cfguard bound accepts the ends of its ranges (p1 0 and 1, var1 0 and 0.25, a delta just
// under 0.5) and refuses, as usage errors, a missing or infinite --kl, a delta of 0 or 0.5 and a
// var1 over 0.25.
func TestBoundRanges(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"--p1", "0", "--kl", "0"}, 0},
		{[]string{"--p1", "1", "--kl", "0.1", "--var1", "0"}, 0},
		{[]string{"--p1", "0.9", "--kl", "0.1", "--var1", "0.25", "--delta", "0.4999"}, 0},
		{[]string{"--p1", "0.9"}, 2},
		{[]string{"--p1", "0.9", "--kl", "+Inf"}, 2},
		{[]string{"--p1", "0.9", "--kl", "0.1", "--delta", "0"}, 2},
		{[]string{"--p1", "0.9", "--kl", "0.1", "--delta", "0.5"}, 2},
		{[]string{"--p1", "0.9", "--kl", "0.1", "--var1", "0.26"}, 2},
	} {
		if code, out, errs := proc.RunCLI(t, append([]string{"bound"}, tc.args...)...); code != tc.code {
			t.Errorf("bound %v: exit %d, want %d; %s%s", tc.args, code, tc.code, out, errs)
		}
	}
}

// gen-key names the key k1 unless --id says otherwise; an id it cannot take is a usage error.
func TestGenKeyID(t *testing.T) {
	if code, key, errs := proc.RunCLI(t, "gen-key"); code != 0 || !strings.HasPrefix(key, "k1:") {
		t.Errorf("gen-key: exit %d, %q, %s; want a key named k1", code, key, errs)
	}
	if code, key, errs := proc.RunCLI(t, "gen-key", "--id", "a b"); code != 2 || key != "" || !strings.Contains(errs, "--id") {
		t.Errorf("gen-key --id 'a b': exit %d, %q, %s; want 2 naming --id", code, key, errs)
	}
}
