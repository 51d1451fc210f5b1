package deploy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/tooltest"
)

// imageBuildsEnv asks for the image builds. deploy/docker/build.sh builds with -trimpath on a
// copy of the build context, so it shares no compiled package with go test's own builds and
// takes minutes on a cold build cache: the tests that need its binaries skip unless this is 1.
// .ci/run sets it in a step of its own.
const imageBuildsEnv = "CFGUARD_IMAGE_BUILDS"

// imageBuild is what deploy/docker/build.sh built for one variant, once per test binary, on
// the build context (see copyBuildContext).
type imageBuild struct {
	once sync.Once
	dir  string
	err  error
	took time.Duration
}

var imageBuilds = map[string]*imageBuild{"static": {}, "openblas": {}}

// imageBinaries builds (once per variant) and returns the directory holding cfguard and
// cfguard-healthcheck as the image's build stage of that variant (static or openblas) builds
// them, and how long the build took.
func imageBinaries(t testing.TB, variant string) (string, time.Duration) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("the image is linux; build.sh is tested on linux")
	}
	if os.Getenv(imageBuildsEnv) != "1" {
		t.Skipf("builds the image's binaries with deploy/docker/build.sh (minutes on a cold build cache); "+
			"run with %s=1 (.ci/run does, in its image step)", imageBuildsEnv)
	}
	b, ok := imageBuilds[variant]
	if !ok {
		t.Fatalf("no build variant %q (build.sh builds static or openblas)", variant)
	}
	b.once.Do(func() {
		root := tooltest.RepoRoot(t)
		var ctxDir string
		ctxDir, b.err = os.MkdirTemp("", "cfguard-docker-context-")
		if b.err != nil {
			return
		}
		scratch = append(scratch, ctxDir)
		if b.err = copyBuildContext(root, ctxDir); b.err != nil {
			return
		}
		b.dir = filepath.Join(ctxDir, ".out")
		start := time.Now()
		cmd := exec.Command("sh", "deploy/docker/build.sh", b.dir, variant)
		cmd.Dir = ctxDir
		out, err := cmd.CombinedOutput()
		b.took = time.Since(start)
		if err != nil {
			b.err = fmt.Errorf("deploy/docker/build.sh %s %s: %v\n%s", b.dir, variant, err, out)
		}
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.dir, b.took
}

// plainBuild is `go build ./cmd/cfguard`, once per test binary.
var plainBuild struct {
	once sync.Once
	path string
	err  error
}

// cfguardBinary is the cfguard binary the tests that run `cfguard check-config` on a manifest's
// configuration use. With imageBuildsEnv=1 it is the image's, static variant (the openblas one
// differs only in the predictive engine's matrix products, which check-config does not touch);
// otherwise `go build ./cmd/cfguard` with go test's own settings, which reuses the packages go
// test has compiled and takes seconds.
func cfguardBinary(t testing.TB) string {
	t.Helper()
	if os.Getenv(imageBuildsEnv) == "1" {
		dir, _ := imageBinaries(t, "static")
		return filepath.Join(dir, "cfguard")
	}
	root := tooltest.RepoRoot(t)
	plainBuild.once.Do(func() {
		var dir string
		if dir, plainBuild.err = os.MkdirTemp("", "cfguard-bin-"); plainBuild.err != nil {
			return
		}
		scratch = append(scratch, dir)
		plainBuild.path = filepath.Join(dir, "cfguard")
		cmd := exec.Command("go", "build", "-o", plainBuild.path, "./cmd/cfguard")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			plainBuild.err = fmt.Errorf("go build ./cmd/cfguard: %v\n%s", err, out)
		}
	})
	if plainBuild.err != nil {
		t.Fatal(plainBuild.err)
	}
	return plainBuild.path
}

// scratch are directories made outside a test's TempDir (shared by several tests); TestMain
// removes them.
var scratch []string

func TestMain(m *testing.M) {
	code := m.Run()
	for _, d := range scratch {
		os.RemoveAll(d)
	}
	os.Exit(code)
}
