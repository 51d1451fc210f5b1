package deploy

import (
	"bytes"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// instruction is one Dockerfile instruction, continuation lines joined.
type instruction struct {
	line  int
	cmd   string            // FROM, RUN, COPY, ... (upper case)
	flags map[string]string // --from=build, --chown=65532:65532, --interval=30s
	args  []string          // the exec form's JSON array, or the shell form split on blanks
	exec  bool              // args came from a JSON array
}

type stage struct {
	name, base string
	ins        []instruction
}

// parseDockerfile reads the subset of the Dockerfile syntax ours uses: comments, line
// continuations, --flags, exec (JSON) and shell forms, and ${ARG} defaults declared before the
// first FROM substituted into FROM.
func parseDockerfile(text string) ([]stage, error) {
	var stages []stage
	globalArgs := map[string]string{}
	lines := strings.Split(text, "\n")
	for i := 0; i < len(lines); i++ {
		start := i + 1
		l := strings.TrimSpace(lines[i])
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		for strings.HasSuffix(l, `\`) && i+1 < len(lines) {
			i++
			next := strings.TrimSpace(lines[i])
			if strings.HasPrefix(next, "#") {
				continue
			}
			l = strings.TrimSuffix(l, `\`) + " " + next
		}
		cmd, rest, _ := strings.Cut(l, " ")
		in := instruction{line: start, cmd: strings.ToUpper(cmd), flags: map[string]string{}}
		rest = strings.TrimSpace(rest)
		for strings.HasPrefix(rest, "--") {
			flag, after, _ := strings.Cut(rest, " ")
			k, v, _ := strings.Cut(strings.TrimPrefix(flag, "--"), "=")
			if in.cmd == "RUN" && k == "mount" {
				k = "mount:" + v // several mounts
			}
			in.flags[k] = v
			rest = strings.TrimSpace(after)
		}
		if in.cmd == "HEALTHCHECK" {
			c, after, _ := strings.Cut(rest, " ")
			if c != "CMD" {
				return nil, fmt.Errorf("line %d: HEALTHCHECK %s: want CMD", start, c)
			}
			rest = strings.TrimSpace(after)
		}
		if strings.HasPrefix(rest, "[") {
			if err := json.Unmarshal([]byte(rest), &in.args); err != nil {
				return nil, fmt.Errorf("line %d: %s: bad JSON array: %v", start, in.cmd, err)
			}
			in.exec = true
		} else {
			in.args = strings.Fields(rest)
		}
		switch {
		case in.cmd == "ARG" && len(stages) == 0:
			k, v, _ := strings.Cut(in.args[0], "=")
			globalArgs[k] = v
		case in.cmd == "FROM":
			s := stage{base: os.Expand(in.args[0], func(k string) string { return globalArgs[k] })}
			if len(in.args) == 3 && strings.EqualFold(in.args[1], "AS") {
				s.name = in.args[2]
			}
			stages = append(stages, s)
		case len(stages) == 0:
			return nil, fmt.Errorf("line %d: %s before the first FROM", start, in.cmd)
		default:
			stages[len(stages)-1].ins = append(stages[len(stages)-1].ins, in)
		}
	}
	return stages, nil
}

func (s stage) all(cmd string) []instruction {
	var out []instruction
	for _, in := range s.ins {
		if in.cmd == cmd {
			out = append(out, in)
		}
	}
	return out
}

// last returns the stage's last instruction cmd (the one that counts for USER, CMD, ...).
func (s stage) last(t *testing.T, cmd string) instruction {
	t.Helper()
	all := s.all(cmd)
	if len(all) == 0 {
		t.Fatalf("stage %s has no %s", s.name, cmd)
	}
	return all[len(all)-1]
}

func readDockerfile(t *testing.T) []stage {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(tooltest.RepoRoot(t), "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	stages, err := parseDockerfile(string(b))
	if err != nil {
		t.Fatalf("Dockerfile: %v", err)
	}
	return stages
}

// dockerignore returns the matcher Docker applies to the build context.
func dockerignore(root string) (*patternmatcher.PatternMatcher, error) {
	f, err := os.Open(filepath.Join(root, ".dockerignore"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	patterns, err := ignorefile.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf(".dockerignore: %w", err)
	}
	return patternmatcher.New(patterns)
}

// copyBuildContext copies into dst the files of root that the Docker client would send as the
// build context: everything .dockerignore does not exclude (moby/patternmatcher, the matcher
// the Docker client and BuildKit use).
func copyBuildContext(root, dst string) error {
	pm, err := dockerignore(root)
	if err != nil {
		return err
	}
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil || rel == "." {
			return err
		}
		excluded, err := pm.MatchesOrParentMatches(filepath.ToSlash(rel))
		if err != nil {
			return err
		}
		if excluded {
			if d.IsDir() && !pm.Exclusions() {
				return filepath.SkipDir
			}
			return nil
		}
		target := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s: not a regular file (the build context holds only files and directories)", rel)
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		// A file let through inside an excluded directory (an exception, !dir/file) brings its
		// directories with it, as the Docker client's context does.
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		return os.WriteFile(target, b, info.Mode().Perm())
	})
}

// dockerConfig is deploy/docker/config.yaml, the image's default configuration.
func dockerConfig(t *testing.T) (*config.Config, string) {
	t.Helper()
	p := filepath.Join(tooltest.RepoRoot(t), "deploy", "docker", "config.yaml")
	c, err := config.LoadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return c, p
}

const (
	imageConfigPath = "/etc/cfguard/config.yaml"
	imageBinDir     = "/usr/local/bin/"
	nonrootUID      = "65532"
)

// defaultTarget is the stage `docker build` builds without --target: the last one.
func defaultTarget(stages []stage) stage { return stages[len(stages)-1] }

// targetVariant is the build.sh variant (static or openblas) of the cfguard binary that the
// target stage copies from a build stage.
func targetVariant(stages []stage, target stage) (string, error) {
	byName := map[string]stage{}
	for _, s := range stages {
		byName[s.name] = s
	}
	for _, in := range target.all("COPY") {
		from, ok := in.flags["from"]
		if !ok || !slices.ContainsFunc(in.args[:len(in.args)-1], func(src string) bool { return path.Base(src) == "cfguard" }) {
			continue
		}
		for _, run := range byName[from].all("RUN") {
			if i := slices.Index(run.args, "deploy/docker/build.sh"); i >= 0 && i+2 < len(run.args) {
				return run.args[i+2], nil
			}
		}
		return "", fmt.Errorf("stage %s copies cfguard from stage %s, which does not run deploy/docker/build.sh OUT VARIANT", target.name, from)
	}
	return "", fmt.Errorf("stage %s copies no cfguard from a build stage", target.name)
}

// TestDockerfileStages checks what the image promises: a non-root default target that runs the
// OpenBLAS build, whose entrypoint runs the daemon on the image's configuration, with state_dir
// as a VOLUME and a health check binary that the build produces; and a static target (pure Go,
// distroless) that keeps the same contract.
func TestDockerfileStages(t *testing.T) {
	root := tooltest.RepoRoot(t)
	stages := readDockerfile(t)
	byName := map[string]stage{}
	for _, s := range stages {
		byName[s.name] = s
	}
	for _, name := range []string{"source", "build-static", "build-openblas", "openblas", "static"} {
		if _, ok := byName[name]; !ok {
			t.Fatalf("no stage %q", name)
		}
	}
	if def := defaultTarget(stages); def.name != "openblas" {
		t.Fatalf("the default target (last stage) is %q, want openblas (the image users pull runs the fast engine)", def.name)
	}
	cfg, _ := dockerConfig(t)
	_, port, err := net.SplitHostPort(cfg.HTTP.Listen)
	if err != nil {
		t.Fatal(err)
	}
	pm, err := dockerignore(root)
	if err != nil {
		t.Fatal(err)
	}

	// What each build stage's build.sh writes, and the variant it builds.
	built := map[string][]string{}
	for name, variant := range map[string]string{"build-static": "static", "build-openblas": "openblas"} {
		var calls []instruction
		for _, in := range byName[name].all("RUN") {
			if slices.Contains(in.args, "deploy/docker/build.sh") {
				calls = append(calls, in)
			}
		}
		if len(calls) != 1 {
			t.Fatalf("stage %s runs deploy/docker/build.sh %d times, want once", name, len(calls))
		}
		a := calls[0].args
		i := slices.Index(a, "deploy/docker/build.sh")
		if len(a) < i+3 || a[i+2] != variant {
			t.Fatalf("stage %s: %v, want build.sh OUT %s", name, a, variant)
		}
		out := a[i+1]
		built[name] = []string{path.Join(out, "cfguard"), path.Join(out, "cfguard-healthcheck")}
		for j, w := range a {
			if w == "mkdir" && j+2 < len(a) && a[j+1] == "-p" {
				built[name] = append(built[name], a[j+2])
			}
		}
	}
	if !strings.Contains(strings.Join(byName["build-openblas"].all("RUN")[0].args, " "), "libopenblas-dev") {
		t.Error("stage build-openblas does not install libopenblas-dev before building")
	}
	if v, err := targetVariant(stages, defaultTarget(stages)); err != nil || v != "openblas" {
		t.Errorf("the default target's cfguard is build.sh's %q variant (%v), want openblas", v, err)
	}
	if v, err := targetVariant(stages, byName["static"]); err != nil || v != "static" {
		t.Errorf("the static target's cfguard is build.sh's %q variant (%v), want static", v, err)
	}

	for _, s := range stages {
		for _, in := range s.all("COPY") {
			srcs, dst := in.args[:len(in.args)-1], in.args[len(in.args)-1]
			from, ok := in.flags["from"]
			for _, src := range srcs {
				switch {
				case ok:
					if !slices.Contains(built[from], src) {
						t.Errorf("line %d: COPY --from=%s %s: that stage builds only %v", in.line, from, src, built[from])
					}
				default:
					if _, err := os.Stat(filepath.Join(root, src)); err != nil {
						t.Errorf("line %d: COPY %s: %v", in.line, src, err)
					} else if ex, _ := pm.MatchesOrParentMatches(src); ex && src != "." {
						t.Errorf("line %d: COPY %s: .dockerignore excludes it from the build context", in.line, src)
					}
				}
			}
			_ = dst
		}
	}

	for _, name := range []string{"static", "openblas"} {
		s := byName[name]
		t.Run(name, func(t *testing.T) {
			switch name {
			case "static":
				if !strings.HasPrefix(s.base, "gcr.io/distroless/static-") || !strings.HasSuffix(s.base, ":nonroot") {
					t.Errorf("base %s, want gcr.io/distroless/static-*:nonroot", s.base)
				}
			case "openblas":
				if !strings.HasPrefix(s.base, "debian:") {
					t.Errorf("base %s, want debian:*", s.base)
				}
			}
			if u := s.last(t, "USER").args[0]; u != nonrootUID+":"+nonrootUID {
				t.Errorf("USER %s, want %s:%s (non-root)", u, nonrootUID, nonrootUID)
			}
			if v := s.last(t, "VOLUME"); !v.exec || !slices.Equal(v.args, []string{cfg.StateDir}) {
				t.Errorf("VOLUME %v, want [%q] (state_dir of deploy/docker/config.yaml)", v.args, cfg.StateDir)
			}
			entry, cmd := s.last(t, "ENTRYPOINT"), s.last(t, "CMD")
			if !entry.exec || !cmd.exec {
				t.Error("ENTRYPOINT and CMD must be exec form (signals reach cfguard, no shell in the image)")
			}
			argv := append(append([]string{}, entry.args...), cmd.args...)
			if want := []string{imageBinDir + "cfguard", "run", "--config", imageConfigPath}; !slices.Equal(argv, want) {
				t.Errorf("ENTRYPOINT+CMD %q, want %q", argv, want)
			}
			if e := s.last(t, "EXPOSE"); !slices.Equal(e.args, []string{port}) {
				t.Errorf("EXPOSE %v, want %s (http.listen %s)", e.args, port, cfg.HTTP.Listen)
			}
			hc := s.last(t, "HEALTHCHECK")
			if !hc.exec || len(hc.args) == 0 || hc.args[0] != imageBinDir+"cfguard-healthcheck" {
				t.Errorf("HEALTHCHECK CMD %v, want %scfguard-healthcheck", hc.args, imageBinDir)
			}
			copied := map[string]bool{}
			for _, in := range s.all("COPY") {
				dst := in.args[len(in.args)-1]
				for _, src := range in.args[:len(in.args)-1] {
					if strings.HasSuffix(dst, "/") {
						copied[dst+path.Base(src)] = true
					} else {
						copied[dst] = true
					}
					if src == "deploy/docker/config.yaml" && dst != imageConfigPath {
						t.Errorf("line %d: the configuration goes to %s, want %s", in.line, dst, imageConfigPath)
					}
				}
			}
			for _, want := range []string{argv[0], hc.args[0], imageConfigPath} {
				if !copied[want] {
					t.Errorf("nothing copies %s into the image", want)
				}
			}
		})
	}
}

// TestStaticBuild runs the Dockerfile's static build (`--target static`: deploy/docker/build.sh
// on the build context .dockerignore lets through), checks the binary is static, then runs it as
// the image would (runAsImage).
func TestStaticBuild(t *testing.T) {
	bin, took := imageBinaries(t, "static")
	t.Logf("build.sh static took %v", took.Round(time.Millisecond))
	cfguard, healthcheck := filepath.Join(bin, "cfguard"), filepath.Join(bin, "cfguard-healthcheck")
	for _, p := range []string{cfguard, healthcheck} {
		if err := assertStatic(p); err != nil {
			t.Error(err)
		}
	}
	fileCmd := tooltest.Command(t, "apt-get install file", "file")
	lddCmd := tooltest.Command(t, "apt-get install libc-bin", "ldd")
	for _, p := range []string{cfguard, healthcheck} {
		out, err := exec.Command(fileCmd, p).CombinedOutput()
		if err != nil || !bytes.Contains(out, []byte("statically linked")) {
			t.Errorf("file %s: %s (%v), want statically linked", filepath.Base(p), out, err)
		}
		// ldd exits 1 on a static binary and says so.
		out, _ = exec.Command(lddCmd, p).CombinedOutput()
		if !bytes.Contains(out, []byte("not a dynamic executable")) && !bytes.Contains(out, []byte("statically linked")) {
			t.Errorf("ldd %s: %s, want not a dynamic executable", filepath.Base(p), out)
		}
	}
	runAsImage(t, cfguard, healthcheck)
}

// runAsImage runs `cfguard version`, then `cfguard check-config` on the image's configuration,
// then the daemon as the image would (that configuration, adapted only to loopback and a
// temporary state_dir), checks it with the image's health check binary and the export in the
// volume, and that it stops cleanly on SIGTERM.
func runAsImage(t *testing.T, cfguard, healthcheck string) {
	t.Helper()
	if out, err := exec.Command(cfguard, "version").CombinedOutput(); err != nil || !bytes.Contains(out, []byte("cfguard")) {
		t.Fatalf("cfguard version: %v\n%s", err, out)
	}

	// The image's configuration as shipped passes check-config.
	_, cfgPath := dockerConfig(t)
	if out, err := exec.Command(cfguard, "check-config", "--config", cfgPath).CombinedOutput(); err != nil {
		t.Fatalf("cfguard check-config --config deploy/docker/config.yaml: %v\n%s", err, out)
	}

	// Run it as the image does, on loopback with its state in a temporary directory.
	dir := t.TempDir()
	conf := adaptConfig(t, cfgPath, map[string]any{
		"http.listen": "127.0.0.1:0", "state_dir": filepath.Join(dir, "state"), "model.export_dir": filepath.Join(dir, "state", "export"),
		"kafka.embedded_listen": "127.0.0.1:0",
	})
	var logs tooltest.Output
	cmd := exec.Command(cfguard, "run", "--config", conf)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	cmd.Env = append(os.Environ(), "CFGUARD_HTTP_TOKEN=", "CFGUARD_HTTP_METRICS_TOKEN=")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-exited
		}
	})
	check := func(url string) (int, string) {
		c := exec.Command(healthcheck, "-timeout", "2s", url)
		out, err := c.CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode(), string(out)
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0, string(out)
	}
	var addr string // http.listen is 127.0.0.1:0: the daemon logs the port it bound
	waitfor.Cond(t, 60*time.Second, "cfguard-healthcheck /healthz to pass", func() bool {
		select {
		case err := <-exited:
			t.Fatalf("cfguard exited before it was healthy: %v\n%s", err, logs.String())
		default:
		}
		if addr = logs.Logged("HTTP API listening", "addr"); addr == "" {
			return false
		}
		code, _ := check("http://" + addr + "/healthz")
		return code == 0
	})
	waitfor.Cond(t, 30*time.Second, "cfguard-healthcheck /readyz to pass", func() bool { code, _ := check("http://" + addr + "/readyz"); return code == 0 })
	if code, out := check("http://" + addr + "/nope"); code != 1 {
		t.Errorf("cfguard-healthcheck on a 404: exit %d (%s), want 1", code, out)
	}
	// The posterior export lands in the volume.
	waitfor.Cond(t, 10*time.Second, "the export in state_dir/export", func() bool {
		_, e1 := os.Stat(filepath.Join(dir, "state", "export", "model.json"))
		_, e2 := os.Stat(filepath.Join(dir, "state", "export", "model.safetensors"))
		return e1 == nil && e2 == nil
	})
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("cfguard after SIGTERM: %v\n%s", err, logs.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("cfguard did not stop within 30 s of SIGTERM\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), `"msg":"cfguard stopped"`) {
		t.Errorf("no JSON log line saying cfguard stopped (log.format: json):\n%s", logs.String())
	}
}

// TestDefaultImageBuild builds the binaries of the default target (the image `docker build`
// makes without --target) as its build stage does, checks that cfguard needs libopenblas.so.0
// (the ELF's DT_NEEDED) and that the Debian package providing it here is one the default target
// installs, then runs it as the image would (runAsImage).
func TestDefaultImageBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the cgo build takes minutes on a cold build cache")
	}
	stages := readDockerfile(t)
	def := defaultTarget(stages)
	variant, err := targetVariant(stages, def)
	if err != nil {
		t.Fatal(err)
	}
	if variant != "openblas" {
		t.Fatalf("the default target %s builds cfguard as %q, want openblas", def.name, variant)
	}
	tooltest.Command(t, "apt-get install libopenblas-dev", "gcc")
	lddCmd := tooltest.Command(t, "apt-get install libc-bin", "ldd")
	dpkg := tooltest.Command(t, "a Debian system", "dpkg")
	bin, took := imageBinaries(t, variant)
	t.Logf("build.sh %s took %v", variant, took.Round(time.Millisecond))
	cfguard, healthcheck := filepath.Join(bin, "cfguard"), filepath.Join(bin, "cfguard-healthcheck")
	libs, err := neededLibraries(cfguard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(libs, "libopenblas.so.0") {
		t.Fatalf("the default image's cfguard needs %v, want libopenblas.so.0 among them (built without -tags openblas?)", libs)
	}
	if err := assertStatic(healthcheck); err != nil {
		t.Error(err)
	}
	lddOut, err := exec.Command(lddCmd, cfguard).CombinedOutput()
	if err != nil {
		t.Fatalf("ldd: %v\n%s", err, lddOut)
	}
	m := regexp.MustCompile(`libopenblas\.so\.0 => (\S+)`).FindSubmatch(lddOut)
	if m == nil {
		t.Fatalf("ldd does not resolve libopenblas.so.0:\n%s", lddOut)
	}
	owner, err := exec.Command(dpkg, "-S", string(m[1])).CombinedOutput()
	if err != nil {
		// dpkg knows the path behind the alternatives symlink.
		real, _ := filepath.EvalSymlinks(string(m[1]))
		owner, err = exec.Command(dpkg, "-S", real).CombinedOutput()
		if err != nil {
			t.Fatalf("dpkg -S %s: %v\n%s", real, err, owner)
		}
	}
	pkg, _, _ := strings.Cut(string(owner), ":")
	if !slices.ContainsFunc(def.all("RUN"), func(in instruction) bool { return slices.Contains(in.args, pkg) }) {
		t.Errorf("libopenblas.so.0 comes from Debian package %s, which the default target %s does not install", pkg, def.name)
	}
	runAsImage(t, cfguard, healthcheck)
}

// neededLibraries is the ELF file's DT_NEEDED entries: the shared libraries it links.
func neededLibraries(p string) ([]string, error) {
	f, err := elf.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return f.ImportedLibraries()
}

// assertStatic reads the ELF file: no program interpreter and no needed shared library.
func assertStatic(p string) error {
	f, err := elf.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return fmt.Errorf("%s has a program interpreter: it is dynamically linked", filepath.Base(p))
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		return fmt.Errorf("%s needs shared libraries %v", filepath.Base(p), libs)
	}
	return nil
}

// adaptConfig writes a copy of the YAML configuration at src with the given dotted keys set,
// and returns its path.
func adaptConfig(t *testing.T, src string, set map[string]any) string {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	return adaptConfigText(t, b, set)
}

func adaptConfigText(t *testing.T, text []byte, set map[string]any) string {
	t.Helper()
	var m map[string]any
	if err := yaml.Unmarshal(text, &m); err != nil {
		t.Fatal(err)
	}
	if m == nil {
		m = map[string]any{}
	}
	for key, v := range set {
		parts := strings.Split(key, ".")
		cur := m
		for _, p := range parts[:len(parts)-1] {
			next, ok := cur[p].(map[string]any)
			if !ok {
				next = map[string]any{}
				cur[p] = next
			}
			cur = next
		}
		cur[parts[len(parts)-1]] = v
	}
	out, err := yaml.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, out, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
