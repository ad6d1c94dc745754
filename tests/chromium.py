"""Headless Chromium over the DevTools protocol (a pipe, no extra package): load a page at a
given width, measure its layout, take a full-page screenshot."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium; `open(url, width)` gives a Page. Use as a context manager."""

    def __init__(self, profile: Path) -> None:
        assert CHROMIUM is not None
        # --remote-debugging-pipe: the browser reads commands on fd 3 and writes on fd 4.
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()

        def wire() -> None:  # in the child: its ends of the pipes become fds 3 and 4
            reads, writes = os.dup(to_child), os.dup(from_child)  # above 4, whatever they were
            os.dup2(reads, 3)
            os.dup2(writes, 4)

        self.process = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            pass_fds=(3, 4, to_child, from_child),
            preexec_fn=wire,  # only dup/dup2 after the fork: safe
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""
        self._ids = iter(range(1, 1 << 30))

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError, RuntimeError):  # already gone
            self.send("Browser.close")
        self.process.wait(timeout=30)
        os.close(self._write)
        os.close(self._read)

    def _message(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(raw)

    def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """A command's result (events met on the way are dropped, except the one waited for)."""
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._message()
            if reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def wait_for(self, event: str) -> None:
        while self._message().get("method") != event:
            pass

    def open(self, url: str, width: int, height: int = 900) -> Page:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send(
            "Emulation.setDeviceMetricsOverride",
            session,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=width < 600,
        )
        self.send("Page.enable", session)
        self.send("Page.navigate", session, url=url)
        self.wait_for("Page.loadEventFired")
        return Page(self, session)


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def evaluate(self, expression: str) -> Any:
        """A JS expression's value, evaluated by DevTools (the page's own CSP forbids scripts:
        the page never runs one, the test measures it from outside)."""
        result = self.browser.send(
            "Runtime.evaluate", self.session, expression=expression, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        shot = self.browser.send(
            "Page.captureScreenshot", self.session, format="png", captureBeyondViewport=True
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


#: Layout facts of a report page, measured in the browser: section order, labels clipped by
#: their chart, legends over a chart's plotting area, horizontal overflow.
LAYOUT = r"""
(() => {
  const box = (e) => e.getBoundingClientRect();
  const overlap = (a, b) =>
    Math.max(0, Math.min(a.right, b.right) - Math.max(a.left, b.left)) *
    Math.max(0, Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top));
  document.querySelectorAll('details').forEach((d) => (d.open = true));
  const clipped = [], covered = [];
  let charts = 0, labels = 0, legends = 0;
  for (const svg of document.querySelectorAll('figure svg, .card .plot svg')) {
    charts += 1;
    const frame = box(svg);
    for (const text of svg.querySelectorAll('text')) {
      const r = box(text);
      if (r.width === 0 && r.height === 0) continue;
      labels += 1;
      if (r.left < frame.left - 1 || r.right > frame.right + 1 ||
          r.top < frame.top - 1 || r.bottom > frame.bottom + 1) {
        clipped.push([svg.closest('[id]').id, text.textContent]);
      }
    }
    const areas = [...svg.querySelectorAll('rect.plot-area')].map(box);
    for (const legend of svg.querySelectorAll('g.legend')) {
      legends += 1;
      for (const area of areas) {
        if (overlap(box(legend), area) > 0) covered.push(svg.closest('[id]').id);
      }
    }
  }
  const order = [...document.querySelectorAll('h2, summary')].map((e) => e.textContent.trim());
  return {
    charts, labels, legends, clipped, covered, order,
    scrollWidth: document.documentElement.scrollWidth,
    title: document.title,
  };
})()
"""
