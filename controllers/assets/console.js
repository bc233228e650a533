// moor console: follows the server's live stream (/live) and, when what this page
// shows changed, fetches the page's new body. Nothing here runs on a timer: the
// server says when to fetch.
(function () {
  "use strict";
  var topics = document.body.getAttribute("data-live") || "";
  var badge = document.getElementById("live");
  var busy = false;
  var again = false;
  function mark(on, text) {
    badge.textContent = text;
    badge.className = on ? "live on" : "live off";
  }
  function refresh() {
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    again = false;
    fetch(location.href, { headers: { "X-Moor-Fragment": "1" }, credentials: "same-origin" })
      .then(function (r) { return r.text(); })
      .then(function (body) {
        var main = document.querySelector("main");
        // Keep what the reader typed in a filter, and the open details.
        var open = Array.prototype.map.call(
          main.querySelectorAll("details[open] summary"), function (s) { return s.textContent; });
        var active = document.activeElement;
        if (active && active.form && main.contains(active)) {
          busy = false;
          return;
        }
        main.innerHTML = body;
        Array.prototype.forEach.call(main.querySelectorAll("details summary"), function (s) {
          if (open.indexOf(s.textContent) >= 0) { s.parentNode.open = true; }
        });
        document.body.setAttribute("data-refreshed", String(Date.now()));
      })
      .catch(function () { mark(false, "offline"); })
      .then(function () {
        busy = false;
        if (again) { refresh(); }
      });
  }
  if (!window.EventSource) {
    mark(false, "no live updates");
    return;
  }
  var source = new EventSource("/live?topics=" + encodeURIComponent(topics));
  source.addEventListener("hello", function () { mark(true, "live"); });
  source.addEventListener("changed", refresh);
  // EventSource reconnects by itself; after a gap the page may be stale.
  var lost = false;
  source.onerror = function () { lost = true; mark(false, "reconnecting"); };
  source.onopen = function () {
    if (lost) { lost = false; refresh(); }
  };
})();
