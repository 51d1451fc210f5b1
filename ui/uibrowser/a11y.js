// Accessibility rules checked over the rendered DOM. Each violation is a string naming the rule
// and the element. Contrast follows WCAG 2's relative luminance (4.5:1 for text, 3:1 for large text).
(() => {
  const out = [];
  const name = (el) => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') + (el.className && typeof el.className === 'string' ? '.' + el.className.split(' ').join('.') : '');
  const visible = (el) => { const s = getComputedStyle(el); const r = el.getBoundingClientRect(); return s.display !== 'none' && s.visibility !== 'hidden' && r.width > 0 && r.height > 0 && r.left >= -1000; };
  if (!document.documentElement.lang) out.push('html-lang: the page has no lang attribute');
  if (!document.title.trim()) out.push('document-title: the page has no title');
  const h1 = document.querySelectorAll('h1');
  if (h1.length !== 1) out.push('one-h1: the page has ' + h1.length + ' h1 elements');
  if (document.querySelectorAll('main').length !== 1) out.push('landmark-main: want exactly one main');
  document.querySelectorAll('nav').forEach((n) => { if (document.querySelectorAll('nav').length > 1 && !n.getAttribute('aria-label')) out.push('landmark-nav-label: ' + name(n)); });
  const ids = {};
  document.querySelectorAll('[id]').forEach((e) => { if (ids[e.id]) out.push('duplicate-id: ' + e.id); ids[e.id] = true; });
  document.querySelectorAll('img').forEach((e) => { if (!e.hasAttribute('alt')) out.push('image-alt: ' + name(e)); });
  document.querySelectorAll('svg[role="img"]').forEach((e) => { if (!e.getAttribute('aria-labelledby') && !e.getAttribute('aria-label')) out.push('svg-name: ' + name(e)); });
  document.querySelectorAll('input:not([type="hidden"]), select, textarea').forEach((e) => {
    const labelled = (e.id && document.querySelector('label[for="' + e.id + '"]')) || e.getAttribute('aria-label') || e.closest('label');
    if (!labelled) out.push('label: ' + name(e));
  });
  document.querySelectorAll('a').forEach((e) => { if (!e.getAttribute('href')) out.push('link-href: ' + name(e)); if (!e.textContent.trim() && !e.getAttribute('aria-label')) out.push('link-name: ' + name(e)); });
  document.querySelectorAll('button').forEach((e) => { if (!e.textContent.trim() && !e.getAttribute('aria-label')) out.push('button-name: ' + name(e)); });
  document.querySelectorAll('table').forEach((t) => { if (!t.querySelector('th')) out.push('table-headers: ' + name(t)); });
  const rgb = (c) => { const m = c.match(/rgba?\(([^)]+)\)/); if (!m) return null; const p = m[1].split(',').map(Number); return { r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1 }; };
  const lum = (c) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); }; return 0.2126 * f(c.r) + 0.7152 * f(c.g) + 0.0722 * f(c.b); };
  const background = (el) => { for (let e = el; e; e = e.parentElement) { const c = rgb(getComputedStyle(e).backgroundColor); if (c && c.a > 0) return c; } return { r: 255, g: 255, b: 255, a: 1 }; };
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const seen = new Set();
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (!n.textContent.trim() || seen.has(el) || !visible(el) || el.closest('svg')) continue;
    seen.add(el);
    const s = getComputedStyle(el);
    const fg = rgb(s.color), bg = background(el);
    const L1 = lum(fg), L2 = lum(bg);
    const ratio = (Math.max(L1, L2) + 0.05) / (Math.min(L1, L2) + 0.05);
    const size = parseFloat(s.fontSize), bold = parseInt(s.fontWeight, 10) >= 700;
    const need = size >= 24 || (bold && size >= 18.66) ? 3 : 4.5;
    if (ratio < need) out.push('contrast: ' + name(el) + ' ' + ratio.toFixed(2) + ':1 < ' + need + ':1 ("' + n.textContent.trim().slice(0, 30) + '")');
  }
  return out;
})()
