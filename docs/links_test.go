package docs

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// The Markdown files of the repository whose links are checked, relative to this directory.
var markdown = []string{"../README.md", "../assets/data/PROVENANCE.md", "../ledger/testdata/README.md", "*.md"}

var (
	linkRE   = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	htmlIDRE = regexp.MustCompile(`<a (?:id|name)="([^"]+)"`)
	codeRE   = regexp.MustCompile("`[^`]*`")
	// headingLinkRE is a link in a heading: its text is part of the anchor.
	headingLinkRE = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)
)

// markdownFiles is the paths of the Markdown files the tests read (markdown's patterns expanded).
func markdownFiles(t *testing.T) []string {
	t.Helper()
	var files []string
	for _, pat := range markdown {
		m, err := filepath.Glob(pat)
		if err != nil || len(m) == 0 {
			t.Fatalf("no Markdown file matches %s (%v)", pat, err)
		}
		files = append(files, m...)
	}
	return files
}

// TestLinksResolve: every relative link of every Markdown file names a file or directory of the
// repository, and every fragment a heading (or an <a id>) of the Markdown file it points into.
func TestLinksResolve(t *testing.T) {
	files := markdownFiles(t)
	anchors := map[string][]string{} // file -> its anchors, read once
	anchorsOf := func(path string) []string {
		if a, ok := anchors[path]; ok {
			return a
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		anchors[path] = slugs(string(b))
		return anchors[path]
	}
	checked := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for n, line := range prose(string(b)) {
			for _, m := range linkRE.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				checked++
				path, frag, _ := strings.Cut(target, "#")
				dest := f
				if path != "" {
					dest = filepath.Join(filepath.Dir(f), path)
					if _, err := os.Stat(dest); err != nil {
						t.Errorf("%s:%d: link %q: %s does not exist", f, n+1, target, dest)
						continue
					}
				}
				if frag == "" {
					continue
				}
				if !strings.HasSuffix(dest, ".md") {
					t.Errorf("%s:%d: link %q: a fragment into a file that is not Markdown", f, n+1, target)
					continue
				}
				if !slices.Contains(anchorsOf(dest), frag) {
					t.Errorf("%s:%d: link %q: %s has no heading whose anchor is #%s", f, n+1, target, dest, frag)
				}
			}
		}
	}
	if checked < 100 {
		t.Errorf("only %d relative links found: the pattern no longer finds them", checked)
	}
}

// unfenced returns the lines of a Markdown text with fenced code blocks blanked (their line
// numbers kept).
func unfenced(text string) []string {
	lines := strings.Split(text, "\n")
	fenced := false
	for i, l := range lines {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			fenced = !fenced
			lines[i] = ""
		} else if fenced {
			lines[i] = ""
		}
	}
	return lines
}

// prose is unfenced with inline code removed too: neither holds links.
func prose(text string) []string {
	lines := unfenced(text)
	for i, l := range lines {
		lines[i] = codeRE.ReplaceAllString(l, "")
	}
	return lines
}

// slugs returns the anchors GitHub gives the headings of a Markdown text, in order: the
// heading's text lowercased, without what is neither a letter, a digit, a space, '-' nor '_',
// spaces made '-', and "-1", "-2", ... appended to repeats; and the ids of <a id="..."> tags.
func slugs(text string) []string {
	var out []string
	seen := map[string]int{}
	for _, l := range unfenced(text) {
		for _, m := range htmlIDRE.FindAllStringSubmatch(l, -1) {
			out = append(out, m[1])
		}
		if !strings.HasPrefix(l, "#") {
			continue
		}
		h, ok := strings.CutPrefix(strings.TrimLeft(l, "#"), " ")
		if !ok || strings.TrimSpace(h) == "" {
			continue
		}
		s := slug(h)
		if k := seen[s]; k > 0 {
			out = append(out, fmt.Sprintf("%s-%d", s, k))
		} else {
			out = append(out, s)
		}
		seen[s]++
	}
	return out
}

// slug is one heading's anchor, before repeats are numbered: the text of its code spans and
// links kept, their markup dropped.
func slug(h string) string {
	h = headingLinkRE.ReplaceAllString(strings.TrimSpace(h), "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}
