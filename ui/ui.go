package ui

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"

	"github.com/cfguard/cfguard/internal/bearer"
	"github.com/cfguard/cfguard/internal/ident"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config is the UI's share of the daemon's configuration.
type Config struct {
	// Token is http.token: when set, every page but the login form needs it.
	Token string
	// PageSize is how many CEs a list page shows. Default: 50.
	PageSize int
	// Reissue is set when explain.reissue is: a CE's page links the CEs stored under the names
	// the reissuer gives its replacements. Unset, no page names a replacement (a client's own CE
	// may bear such a name).
	Reissue bool
	// Logger receives errors the pages could not show in full. Default: slog.Default().
	Logger *slog.Logger
}

// Cookie is the session cookie's name. Its value is sessionValue(token), not the token.
const Cookie = "cfguard_ui"

// sessionValue is the cookie's value for token: HMAC-SHA-256 keyed by the token over a fixed
// label. It proves the browser was given the token without storing it: a stolen cookie opens the
// UI (as the token would) but cannot be turned back into the token the API takes.
func sessionValue(token string) string {
	mac := hmac.New(sha256.New, []byte(token))
	mac.Write([]byte("cfguard ui session v1"))
	return hex.EncodeToString(mac.Sum(nil))
}

// UI serves the pages. Build it with New; it is safe for concurrent use.
type UI struct {
	cfg   Config
	src   Source
	pages map[string]*template.Template
	mux   *http.ServeMux
	// runbookHTML is docs/RUNBOOK.md rendered once (renderRunbook).
	runbookHTML template.HTML
}

// New returns the UI over src. It panics only if an embedded template does not parse, which
// the package's tests rule out.
func New(cfg Config, src Source) *UI {
	if cfg.PageSize <= 0 {
		cfg.PageSize = 50
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	u := &UI{cfg: cfg, src: src, pages: parsePages("overview", "list", "ce", "certificate", "events", "runbook", "login", "error"),
		runbookHTML: mustRunbook()}
	m := newMux(u.noPage)
	m.HandleFunc("GET /ui/login", u.loginForm)
	m.HandleFunc("POST /ui/login", u.login)
	m.HandleFunc("POST /ui/logout", u.logout)
	m.HandleFunc("/ui/login", u.notAllowed("GET, HEAD, POST", "the sign-in form is read with GET and sent with POST"))
	m.HandleFunc("/ui/logout", u.notAllowed("POST", "signing out is a POST (the button on every page)"))
	m.Handle("GET /ui/{$}", u.auth(u.overview))
	m.Handle("GET /ui/counterfactuals", u.auth(u.list))
	m.Handle("GET /ui/counterfactuals/{id}", u.auth(u.ce))
	m.Handle("GET /ui/counterfactuals/{id}/certificate", u.auth(u.certificate))
	m.Handle("GET /ui/events", u.auth(u.events))
	m.Handle("GET "+runbookPath, u.auth(u.runbook))
	m.HandleFunc("GET /ui", func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, "/ui/", http.StatusMovedPermanently) })
	m.HandleFunc("/ui/", u.noPage)
	u.mux = m
	return u
}

// parsePages parses each named page of templates/ inside the layout.
func parsePages(names ...string) map[string]*template.Template {
	pages := map[string]*template.Template{}
	for _, p := range names {
		pages[p] = template.Must(template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+p+".html"))
	}
	return pages
}

// newMux is a mux that serves the static files under /ui/static/; a path there that names no
// file (a directory included, which the file server would list) goes to noFile.
func newMux(noFile http.HandlerFunc) *http.ServeMux {
	static, _ := fs.Sub(staticFS, "static")
	files := http.StripPrefix("/ui/static/", staticHandler(http.FileServerFS(static)))
	m := http.NewServeMux()
	m.HandleFunc("GET /ui/static/", func(w http.ResponseWriter, r *http.Request) {
		if fi, err := fs.Stat(static, strings.TrimPrefix(r.URL.Path, "/ui/static/")); err != nil || fi.IsDir() {
			noFile(w, r)
			return
		}
		files.ServeHTTP(w, r)
	})
	return m
}

// ServeHTTP serves every path under /ui/.
func (u *UI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	// Pages are ours alone: no frames, no scripts but our own, no inline script.
	h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'none'; frame-ancestors 'none'; form-action 'self'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	u.mux.ServeHTTP(w, r)
}

func staticHandler(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=3600")
		h.ServeHTTP(w, r)
	})
}

// authorized reports whether r carries the token, as a bearer header or as the session cookie.
func (u *UI) authorized(r *http.Request) bool {
	if u.cfg.Token == "" {
		return true
	}
	if got, ok := bearer.Token(r.Header.Get("Authorization")); ok {
		return subtle.ConstantTimeCompare([]byte(got), []byte(u.cfg.Token)) == 1
	}
	c, err := r.Cookie(Cookie)
	return err == nil && subtle.ConstantTimeCompare([]byte(c.Value), []byte(sessionValue(u.cfg.Token))) == 1
}

// auth sends a request without the token to the login form, which returns to the page asked for.
// A wrong bearer token is refused; another Authorization header (the basic auth of
// http.web_config_file, which a browser sends on every request) is no token, and goes to the
// form.
func (u *UI) auth(h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !u.authorized(r) {
			if _, ok := bearer.Token(r.Header.Get("Authorization")); ok {
				u.render(w, http.StatusUnauthorized, "error", page{Title: "Not signed in", Error: "The bearer token is wrong."})
				return
			}
			http.Redirect(w, r, "/ui/login?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
			return
		}
		h(w, r)
	})
}

// safeNext keeps a post-login redirect on the UI: a path under /ui/ once its dot segments are
// resolved (as a browser resolves them, also when percent-encoded), never another host. It
// returns the resolved path with the query, or /ui/.
func safeNext(next string) string {
	if !strings.HasPrefix(next, "/ui/") || strings.HasPrefix(next, "//") || strings.Contains(next, "\\") {
		return "/ui/"
	}
	u, err := url.Parse(next)
	if err != nil || u.Scheme != "" || u.Host != "" || u.Fragment != "" {
		return "/ui/"
	}
	p := path.Clean(u.Path)
	if !strings.HasPrefix(p+"/", "/ui/") {
		return "/ui/"
	}
	if strings.HasSuffix(u.Path, "/") && p != "/" {
		p += "/"
	}
	return (&url.URL{Path: p, RawQuery: u.RawQuery}).String()
}

func (u *UI) loginForm(w http.ResponseWriter, r *http.Request) {
	u.render(w, http.StatusOK, "login", page{Title: "Sign in", Next: safeNext(r.URL.Query().Get("next")), NoNav: true})
}

// sameOrigin refuses a cross-site form post (login CSRF): a browser sends Origin on a POST, and it
// must name this host; where a browser sends no Origin but a Referer, the Referer's host must be
// this host. A client that sends neither (curl) is not a browser another site drives, and the
// session cookie is SameSite=Strict, so no other site's page carries it here.
func sameOrigin(r *http.Request) bool {
	o := r.Header.Get("Origin")
	if o == "" {
		o = r.Header.Get("Referer")
	}
	if o == "" {
		return true
	}
	ou, err := url.Parse(o)
	return err == nil && ou.Host == r.Host
}

func (u *UI) login(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r) {
		u.render(w, http.StatusForbidden, "error", page{Title: "Refused", Error: "A sign-in from another site is refused."})
		return
	}
	if err := r.ParseForm(); err != nil {
		code, msg := formError(err)
		u.render(w, code, "login", page{Title: "Sign in", Error: msg, NoNav: true})
		return
	}
	next := safeNext(r.PostForm.Get("next"))
	if u.cfg.Token == "" {
		http.Redirect(w, r, next, http.StatusSeeOther)
		return
	}
	if subtle.ConstantTimeCompare([]byte(r.PostForm.Get("token")), []byte(u.cfg.Token)) != 1 {
		u.render(w, http.StatusUnauthorized, "login", page{Title: "Sign in", Error: "That token is not the API token (http.token).", Next: next, NoNav: true})
		return
	}
	http.SetCookie(w, &http.Cookie{Name: Cookie, Value: sessionValue(u.cfg.Token), Path: "/ui/", HttpOnly: true,
		Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, next, http.StatusSeeOther)
}

// formError is the status and message for a form ParseForm could not read: 413 naming the limit
// for a body over the daemon's bound (http.max_body_bytes), 400 for any other failure.
func formError(err error) (int, string) {
	if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
		return http.StatusRequestEntityTooLarge, "The form is over " + strconv.FormatInt(mbe.Limit, 10) + " bytes (http.max_body_bytes)."
	}
	return http.StatusBadRequest, "The form could not be read."
}

func (u *UI) logout(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r) {
		u.render(w, http.StatusForbidden, "error", page{Title: "Refused", Error: "A sign-out from another site is refused."})
		return
	}
	http.SetCookie(w, &http.Cookie{Name: Cookie, Value: "", Path: "/ui/", MaxAge: -1, HttpOnly: true, Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/ui/login", http.StatusSeeOther)
}

// noPage answers a path under /ui/ that is no page, or a method no page takes, with a page that
// says so and leads back (not the mux's plain text). It reads nothing, so it asks for no token.
func (u *UI) noPage(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		u.notAllowed("GET, HEAD", "the UI's pages are read with GET (and change nothing)")(w, r)
		return
	}
	u.render(w, http.StatusNotFound, "error", page{Title: "No such page",
		Error: "There is no page at " + ident.Clip(r.URL.EscapedPath(), 256) + ". The UI's pages are the overview, the counterfactuals (and each one's page) and the events: the links above lead to them."})
}

// notAllowed answers a method the path does not take: a 405 page naming the methods it takes
// (allow, also sent as Allow) and why (how).
func (u *UI) notAllowed(allow, how string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", allow)
		u.render(w, http.StatusMethodNotAllowed, "error", page{Title: "Method not allowed",
			Error: r.Method + " " + ident.Clip(r.URL.EscapedPath(), 256) + ": " + how + "."})
	}
}

// render writes a page; a template that fails mid-way has already sent its status, so the
// error is logged.
func (u *UI) render(w http.ResponseWriter, code int, name string, p page) {
	p.LoginNeeded = u.cfg.Token != ""
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	if err := u.pages[name].Execute(w, p); err != nil {
		u.cfg.Logger.Error("ui: rendering a page", "page", name, "err", err)
	}
}

// unavailable shows the 503 page of a read that waits on kind (ErrBlocked, ErrNotYet): what,
// err's text without kind's in parentheses, then next; Retry-After is retryAfter seconds.
func (u *UI) unavailable(w http.ResponseWriter, err, kind error, retryAfter int, title, what, next string) {
	u.cfg.Logger.Info("ui: page "+strings.ToLower(title), "err", err)
	w.Header().Set("Retry-After", strconv.Itoa(retryAfter))
	u.render(w, http.StatusServiceUnavailable, "error", page{Title: title,
		Error: what + " (" + strings.TrimPrefix(err.Error(), kind.Error()+": ") + "). " + next})
}

// fail shows an error page for a read that failed; one that failed with ErrNotYet is a 503 that
// asks to reload in a moment, one that failed with ErrBlocked a 503 that says what ends it.
func (u *UI) fail(w http.ResponseWriter, code int, err error) {
	switch {
	case errors.Is(err, ErrBlocked):
		u.unavailable(w, err, ErrBlocked, 60, "Blocked", "A partition of the counterfactuals is blocked",
			"It does not clear by itself: the runbook's CfguardCounterfactualsNotCaughtUp section says how (upgrade the replica, or skip the request).")
		return
	case errors.Is(err, ErrNotYet):
		u.unavailable(w, err, ErrNotYet, 1, "Not available yet", "The counterfactuals are moving between replicas", "Reload this page in a moment.")
		return
	}
	if code >= 500 {
		u.cfg.Logger.Warn("ui: page failed", "code", code, "err", err)
	} else { // a mistyped address or filter: the page says what is wrong, the log need not
		u.cfg.Logger.Debug("ui: page refused", "code", code, "err", err)
	}
	msg := err.Error()
	if code >= 500 {
		msg = "The daemon could not read its state; its log has the error (level WARN, \"ui: page failed\")."
	}
	u.render(w, code, "error", page{Title: http.StatusText(code), Error: msg})
}

// Refused serves /ui/ on a replica that refused to join its cluster (its settings differ from
// the cluster's): it has no state to show, so every page is a 503 that says why (why: the
// refusal, as /readyz gives it) and what to do, with a link to the runbook's section of the
// alert that fires (CfguardReplicaSettingsDiffer). The runbook page and the static files are
// served, so that the alert's links lead somewhere. It shows nothing /readyz does not.
func Refused(why string) http.Handler {
	u := &UI{cfg: Config{Logger: slog.New(slog.DiscardHandler)}, pages: parsePages("refused", "runbook"), runbookHTML: mustRunbook()}
	refused := func(w http.ResponseWriter, r *http.Request) {
		u.render(w, http.StatusServiceUnavailable, "refused", page{Title: "Not joining the cluster", NoNav: true,
			Error: "This replica refused to join its cluster, so it applies nothing and shows no counterfactual: " + why +
				". Align its configuration file with the cluster's (or give it its own cluster) and restart it."})
	}
	m := newMux(refused)
	m.HandleFunc("GET "+runbookPath, u.runbook)
	m.HandleFunc("/", refused)
	u.mux = m
	return u
}

// Starting serves /ui/ while the daemon starts, before it has a state to show: every page is a
// 503 with Retry-After: retryAfter seconds that says what the start does (phase's answer) and to
// reload; the static files are served as always. It shows nothing /readyz does not.
func Starting(phase func() string, retryAfter int) http.Handler {
	u := &UI{cfg: Config{Logger: slog.New(slog.DiscardHandler)}, pages: parsePages("error")}
	starting := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfter))
		u.render(w, http.StatusServiceUnavailable, "error", page{Title: "Starting", NoNav: true,
			Error: "cfguard is starting: " + phase() + ". Its pages answer once it has started: reload this page in a moment."})
	}
	m := newMux(starting)
	m.HandleFunc("/", starting)
	u.mux = m
	return u
}
