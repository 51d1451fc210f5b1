package docs

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

var (
	// installRE is the Debian install hint a test gives when a tool it needs is missing
	// (tooltest.Missing, tooltest.Command): "apt-get install" and the packages, by name.
	installRE = regexp.MustCompile(`apt-get install ([a-z0-9][a-z0-9.+-]*(?: [a-z0-9][a-z0-9.+-]*)*)`)
	// probeRE is an entry of .ci/run's probe table: [package]="command that shows it".
	probeRE = regexp.MustCompile(`(?m)^\s*\[([a-z0-9][a-z0-9.+-]*)\]=`)
)

// essential are the Debian packages every Debian system has (Essential: yes), which .ci/run
// need not install and the docs need not name.
var essential = []string{"libc-bin", "util-linux"}

// testPackages returns the Debian packages the repository's Go code tells a reader to install
// when a tool is missing. The tooltest package's own tests, which name made-up packages to test
// the hint, are left out.
func testPackages(t *testing.T, root string) []string {
	t.Helper()
	var pkgs []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") ||
			filepath.Base(filepath.Dir(path)) == "tooltest" && strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range installRE.FindAllStringSubmatch(string(b), -1) {
			pkgs = append(pkgs, strings.Fields(m[1])...)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(pkgs)
	return slices.Compact(pkgs)
}

// listAfter returns the text of the file at path from the first occurrence of begin to the first
// occurrence of end after it; it fails t when either is missing (the sentence was reworded: the
// markers here follow it).
func listAfter(t *testing.T, path, begin, end string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), begin)
	if !ok {
		t.Fatalf("%s: no %q: the list of Debian packages this test reads has moved", path, begin)
	}
	list, _, ok := strings.Cut(rest, end)
	if !ok {
		t.Fatalf("%s: no %q after %q", path, end, begin)
	}
	return list
}

// TestCIInstallsWhatTestsNeed: every Debian package a test asks for when its tool is missing is
// installed by .ci/run (its probe table) unless Debian always has it, so that CI, which makes a
// missing tool a failure (CFGUARD_REQUIRE_TOOLS=1), passes on a fresh Debian machine; and the
// README and DEVELOPMENT.md, which list those packages for a newcomer, name each of them.
func TestCIInstallsWhatTestsNeed(t *testing.T) {
	const root = ".."
	script, err := os.ReadFile(filepath.Join(root, ".ci", "run"))
	if err != nil {
		t.Fatal(err)
	}
	var probed []string
	for _, m := range probeRE.FindAllStringSubmatch(string(script), -1) {
		probed = append(probed, m[1])
	}
	docs := map[string]string{
		"README.md": listAfter(t, filepath.Join(root, "README.md"),
			"saying which Debian package to install:", "\n`.ci/run`"),
		"docs/DEVELOPMENT.md": listAfter(t, "DEVELOPMENT.md",
			"`.ci/run` installs the tools some tests need from Debian (", "),"),
	}
	pkgs := testPackages(t, root)
	if len(pkgs) == 0 {
		t.Fatal("no Go file names a Debian package to install: the pattern above is wrong")
	}
	for _, p := range pkgs {
		if slices.Contains(essential, p) {
			continue
		}
		if !slices.Contains(probed, p) {
			t.Errorf("a test asks for the Debian package %s, which .ci/run's probe table does not install", p)
		}
		for name, list := range docs {
			if !strings.Contains(list, "`"+p+"`") {
				t.Errorf("%s: the Debian packages the tests use do not name `%s`", name, p)
			}
		}
	}
}
