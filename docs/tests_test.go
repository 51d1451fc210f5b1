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
	// testFuncRE is the declaration of a test, benchmark or fuzz target in a _test.go file.
	testFuncRE = regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz)\w+)\(`)
	// testNameRE is a test, benchmark or fuzz target named in prose or in a command.
	testNameRE = regexp.MustCompile(`\b(?:Test|Benchmark|Fuzz)[A-Z0-9_]\w*`)
	// citedRE is a package followed by the tests it holds: "`ledger` `TestA`, `TestB`".
	citedRE = regexp.MustCompile("`([\\w./-]+)`\\s+((?:`Test\\w+`(?:,?\\s+(?:and\\s+)?)?)+)")
	// citedNameRE is one test of such a citation.
	citedNameRE = regexp.MustCompile("`(Test\\w+)`")
	// citedAfterRE is a test followed by its package in parentheses: "`TestA` (`ledger`)".
	citedAfterRE = regexp.MustCompile("`(Test\\w+)`\\s+\\(`([\\w./-]+)`")
	// goTestRE is a go test command, up to the end of its code span or line.
	goTestRE = regexp.MustCompile("go test\\b[^`\\n]*")
)

// flagPrefix is the prefix of the functions a go test flag's pattern selects.
var flagPrefix = map[string]string{"-run": "Test", "-bench": "Benchmark"}

// testFuncs maps each directory of the repository (relative to its root, "/" separated) to the
// tests, benchmarks and fuzz targets its _test.go files declare.
func testFuncs(t *testing.T, root string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, filepath.Dir(path))
		if err != nil {
			return err
		}
		for _, m := range testFuncRE.FindAllStringSubmatch(string(b), -1) {
			out[filepath.ToSlash(rel)] = append(out[filepath.ToSlash(rel)], m[1])
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// inPackages returns the names declared in the directories a package pattern names: "x" alone,
// "x/..." x and every directory under it. ok is false when no such directory exists.
func inPackages(funcs map[string][]string, root, pattern string) (names []string, ok bool) {
	dir, tree := strings.CutSuffix(strings.TrimPrefix(pattern, "./"), "/...")
	if dir == "..." {
		dir, tree = ".", true
	}
	if st, err := os.Stat(filepath.Join(root, dir)); err != nil || !st.IsDir() {
		return nil, false
	}
	for d, fs := range funcs {
		if d == dir || tree && (dir == "." || strings.HasPrefix(d, dir+"/")) {
			names = append(names, fs...)
		}
	}
	return names, true
}

// shellWords splits a command line as a shell would for the simple commands the docs show:
// spaces separate words, single and double quotes group them, and a Markdown table's "\|" is
// a "|".
func shellWords(s string) []string {
	s = strings.ReplaceAll(s, `\|`, "|")
	var words []string
	var b strings.Builder
	quote, in := rune(0), false
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			b.WriteRune(r)
		case r == '\'' || r == '"':
			quote, in = r, true
		case r == ' ' || r == '\t':
			if in {
				words = append(words, b.String())
				b.Reset()
				in = false
			}
		default:
			b.WriteRune(r)
			in = true
		}
	}
	if in {
		words = append(words, b.String())
	}
	return words
}

// TestCitedTestsExist: the tests the documentation names are tests of the repository, where
// it says they are. Every Test/Benchmark/Fuzz name in a Markdown file is declared in some
// _test.go file (or begins the names of some, as a -run pattern does); a package cited before
// its tests ("`ledger` `TestA`", "`daemon/...` `TestB`") or after one ("`TestA` (`ledger`)")
// declares each of them; and every
// alternative of a go test command's -run or -bench pattern matches a test or benchmark of the
// packages the command names. Tests move between packages as packages split: this is what keeps
// the commands the docs give working.
func TestCitedTestsExist(t *testing.T) {
	const root = ".."
	funcs := testFuncs(t, root)
	var all []string
	for _, fs := range funcs {
		all = append(all, fs...)
	}
	files := markdownFiles(t)
	names, cited, commands := 0, 0, 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		lineOf := func(off int) int { return strings.Count(text[:off], "\n") + 1 }

		for _, loc := range testNameRE.FindAllStringIndex(text, -1) {
			name := text[loc[0]:loc[1]]
			names++
			if !slices.ContainsFunc(all, func(n string) bool { return strings.HasPrefix(n, name) }) {
				t.Errorf("%s:%d: %s is no test, benchmark or fuzz target of the repository, nor the start of one's name", f, lineOf(loc[0]), name)
			}
		}

		for _, m := range citedRE.FindAllStringSubmatchIndex(text, -1) {
			pkg := text[m[2]:m[3]]
			declared, ok := inPackages(funcs, root, pkg)
			if !ok {
				continue // not a package: a metric, a file, a config key
			}
			for _, tm := range citedNameRE.FindAllStringSubmatch(text[m[4]:m[5]], -1) {
				cited++
				if !slices.Contains(declared, tm[1]) {
					t.Errorf("%s:%d: %s is cited as a test of %s, which does not declare it", f, lineOf(m[0]), tm[1], pkg)
				}
			}
		}

		for _, m := range citedAfterRE.FindAllStringSubmatchIndex(text, -1) {
			name, pkg := text[m[2]:m[3]], text[m[4]:m[5]]
			declared, ok := inPackages(funcs, root, pkg)
			if !ok {
				continue // not a package: a file, a function
			}
			cited++
			if !slices.Contains(declared, name) {
				t.Errorf("%s:%d: %s is cited as a test of %s, which does not declare it", f, lineOf(m[0]), name, pkg)
			}
		}

		for _, loc := range goTestRE.FindAllStringIndex(text, -1) {
			words := shellWords(text[loc[0]:loc[1]])
			var pkgs []string
			patterns := map[string]string{} // flag -> pattern
			for i, w := range words {
				switch {
				case strings.HasPrefix(w, "./") && !strings.Contains(w, "<"): // not a placeholder
					pkgs = append(pkgs, w)
				case (w == "-run" || w == "-bench") && i+1 < len(words):
					patterns[w] = words[i+1]
				}
			}
			if len(pkgs) == 0 || len(patterns) == 0 {
				continue // run in a directory the text names, or runs every test
			}
			commands++
			var declared []string
			for _, p := range pkgs {
				d, ok := inPackages(funcs, root, p)
				if !ok {
					t.Errorf("%s:%d: go test names %s, which is not a directory of the repository", f, lineOf(loc[0]), p)
				}
				declared = append(declared, d...)
			}
			for flag, pat := range patterns {
				if pat == "^$" || pat == "." || strings.ContainsAny(pat, "()[]*+?{}") {
					continue
				}
				prefix := flagPrefix[flag]
				for _, alt := range strings.Split(pat, "|") {
					alt, _, _ = strings.Cut(alt, "/") // a subtest's name after the slash
					re, err := regexp.Compile(alt)
					if err != nil {
						t.Errorf("%s:%d: %s %q: %v", f, lineOf(loc[0]), flag, pat, err)
						continue
					}
					if !slices.ContainsFunc(declared, func(n string) bool { return strings.HasPrefix(n, prefix) && re.MatchString(n) }) {
						t.Errorf("%s:%d: %s %q: %q matches nothing in %s", f, lineOf(loc[0]), flag, pat, alt, strings.Join(pkgs, " "))
					}
				}
			}
		}
	}
	t.Logf("%d names, %d package citations, %d go test commands with packages and patterns checked", names, cited, commands)
	if names < 100 || cited < 20 || commands < 40 {
		t.Errorf("%d names, %d citations, %d commands: the patterns no longer find them", names, cited, commands)
	}
}
