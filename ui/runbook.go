package ui

import (
	"bytes"
	"html/template"
	"net/http"
	"path"
	"strings"

	"github.com/yuin/goldmark"
	"github.com/yuin/goldmark/ast"
	"github.com/yuin/goldmark/extension"
	"github.com/yuin/goldmark/parser"
	"github.com/yuin/goldmark/text"
	"github.com/yuin/goldmark/util"

	"github.com/cfguard/cfguard/docs"
)

// repoBlob is where the repository's files the runbook links to are read: the daemon serves the
// runbook alone.
const repoBlob = "https://github.com/cfguard/cfguard/blob/main/"

// runbookPath is the runbook's page; an alert's section is runbookPath + "#" + its name in lower
// case, the anchor GitHub gives the same heading (alerts/rules.yml's runbook_url).
const runbookPath = "/ui/runbook"

// runbookLink is the UI's link to alert's section of the runbook.
func runbookLink(alert string) string { return runbookPath + "#" + strings.ToLower(alert) }

// renderRunbook renders Markdown as the runbook page's body: GitHub's flavour (tables), every
// heading with the id GitHub gives it (lower case, spaces as dashes), the document's own title
// left to the page, links into the document kept, and links to the repository's other files
// sent to the repository. Raw HTML is left out, as goldmark does by default.
func renderRunbook(src string) (template.HTML, error) {
	md := goldmark.New(
		goldmark.WithExtensions(extension.GFM),
		goldmark.WithParserOptions(parser.WithAutoHeadingID(),
			parser.WithASTTransformers(util.Prioritized(runbookLinks{}, 100))),
	)
	var b bytes.Buffer
	if err := md.Convert([]byte(src), &b); err != nil {
		return "", err
	}
	return template.HTML(b.String()), nil
}

// runbookLinks drops the document's level-1 heading (the page has its own) and points relative
// links outside the document at the repository's copy of the file they name.
type runbookLinks struct{}

func (runbookLinks) Transform(doc *ast.Document, _ text.Reader, _ parser.Context) {
	var titles []ast.Node
	ast.Walk(doc, func(n ast.Node, entering bool) (ast.WalkStatus, error) {
		if !entering {
			return ast.WalkContinue, nil
		}
		switch n := n.(type) {
		case *ast.Heading:
			if n.Level == 1 {
				titles = append(titles, n)
			}
		case *ast.Link:
			n.Destination = []byte(repoLink(string(n.Destination)))
		}
		return ast.WalkContinue, nil
	})
	for _, t := range titles {
		t.Parent().RemoveChild(t.Parent(), t)
	}
}

// repoLink is where a link of docs/RUNBOOK.md leads from the UI: a fragment or an absolute URL as
// it is, a path relative to docs/ into the repository.
func repoLink(dest string) string {
	if dest == "" || strings.HasPrefix(dest, "#") || strings.Contains(dest, "://") || strings.HasPrefix(dest, "mailto:") {
		return dest
	}
	file, frag, _ := strings.Cut(dest, "#")
	// docs/../x is x at the repository's root, which GitHub serves under blob/main/ too.
	link := repoBlob + strings.TrimPrefix(path.Clean("docs/"+file), "/")
	if frag != "" {
		link += "#" + frag
	}
	return link
}

// runbook serves the runbook, rendered at New.
func (u *UI) runbook(w http.ResponseWriter, r *http.Request) {
	u.render(w, http.StatusOK, "runbook", page{Title: "Runbook", Nav: "runbook", Doc: u.runbookHTML})
}

// mustRunbook renders docs.Runbook; the package's tests rule out its failing.
func mustRunbook() template.HTML {
	h, err := renderRunbook(docs.Runbook)
	if err != nil {
		panic("ui: rendering the runbook: " + err.Error())
	}
	return h
}
