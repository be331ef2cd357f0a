// gpucloud console: the one script. Elements with data-poll="URL" are refreshed from that URL
// every data-poll-seconds (default 2) until the fragment they receive says data-settled="true".
// No framework and no build step: fetch, then replace the element's content.
"use strict";

function poll(element) {
  const url = element.dataset.poll;
  const seconds = Number(element.dataset.pollSeconds || "2");
  const settled = () => element.querySelector('[data-settled="true"]') !== null;
  const tick = async () => {
    if (settled()) return;
    try {
      const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "text/html" } });
      if (response.redirected || !response.ok) {
        element.dataset.pollError = String(response.status);  // signed out or gone: stop
        return;
      }
      element.innerHTML = await response.text();
    } catch (err) {
      element.dataset.pollError = "network";  // try again on the next tick
    }
    setTimeout(tick, seconds * 1000);
  };
  setTimeout(tick, seconds * 1000);
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-poll]").forEach(poll);
});
