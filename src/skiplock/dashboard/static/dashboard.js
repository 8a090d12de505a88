// skiplock dashboard: refresh the live part of the page by polling its fragment, and
// small conveniences (select all, confirmations). Plain script, no build step, no CDN.
(function () {
  "use strict";
  var live = document.getElementById("live");

  // A press not yet released: replacing the page under it would leave the release on a
  // new element, and the click would go nowhere.
  var pressed = false;
  document.addEventListener("pointerdown", function () { pressed = true; }, true);
  ["pointerup", "pointercancel"].forEach(function (name) {
    document.addEventListener(name, function () { pressed = false; }, true);
  });

  // Refreshing would throw away what the person is doing: a ticked box, a field being
  // typed, a click under way.
  function busy() {
    if (pressed) {
      return true;
    }
    var active = document.activeElement;
    if (active && live.contains(active) && /^(INPUT|SELECT|TEXTAREA)$/.test(active.tagName)) {
      return true;
    }
    return live.querySelector("input[type=checkbox]:checked") !== null;
  }

  var inFlight = false;
  function refresh() {
    if (!live || !live.dataset.refresh || document.hidden || busy() || inFlight) {
      return;
    }
    inFlight = true;
    fetch(live.dataset.refresh, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (response) {
        if (response.ok && !response.redirected) {
          return response.text().then(function (html) {
            if (!busy()) {
              live.innerHTML = html;
              live.dataset.refreshed = String(Number(live.dataset.refreshed || "0") + 1);
            }
          });
        }
      })
      .catch(function () { /* the next poll tries again */ })
      .then(function () { inFlight = false; });
  }

  if (live) {
    var every = Number(live.dataset.refreshMs) || 3000;
    setInterval(refresh, every);
    // Polling stops while the tab is hidden (refresh returns at once); catch up on return.
    document.addEventListener("visibilitychange", function () {
      if (!document.hidden) { refresh(); }
    });
  }

  document.addEventListener("change", function (event) {
    var box = event.target;
    if (box.matches && box.matches("input[data-select-all]")) {
      var form = box.closest("form");
      form.querySelectorAll("input[name=ids]").forEach(function (each) { each.checked = box.checked; });
    }
  });

  // A confirmation on the button pressed (bulk actions) or on the form (delete).
  var pressed = null;
  document.addEventListener("click", function (event) {
    pressed = event.target.closest ? event.target.closest("button") : null;
  });
  document.addEventListener("submit", function (event) {
    var question = (pressed && pressed.dataset.confirm) || event.target.dataset.confirm;
    pressed = null;
    if (question && !window.confirm(question)) {
      event.preventDefault();
    }
  });
})();
