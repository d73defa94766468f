"""%nanwatch / %%nanwatch: parse the options, call the WatchManager, display the result."""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import linecache
import re
import sys
import warnings
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments
from IPython.display import display
from IPython.utils.process import arg_split
from traitlets import CaselessStrEnum, Float, Int, observe

from ..core.events import AbortAfterBatch, NanDetected
from ..core.sourcelines import format_source, traceback_source
from ..widgets import FrameBrowser
from ..core.options import ON_NAN_CHOICES, OPTIONS
from .manager import LiveStatus, MagicUsageError, WatchManager

__all__ = ["NanwatchMagics", "NanInCell", "CellInterrupted", "CellSyntaxError", "show_nan_detected",
           "find_magics",
           "make_async_cell_rewriter"]


def find_magics(shell: Any) -> NanwatchMagics | None:
    """The NanwatchMagics registered on ``shell`` (IPython keeps them by class name)."""
    found = shell.magics_manager.registry.get("NanwatchMagics")
    return found if isinstance(found, NanwatchMagics) else None


class NanInCell(NanDetected):
    """A %%nanwatch cell stopped at a NaN/Inf; shown as one line, not a traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"NanDetected: {self.event.summary()}", *_diagnosis_line(self.event),
                "(the FrameBrowser above shows the frames; _nanwatch holds the watch)"]


def _diagnosis_line(event: Any) -> list[str]:
    """The stop message's line on why: the kind, the summary and the first fix."""
    diagnosis = getattr(event, "diagnosis", None)
    return [diagnosis.brief()] if diagnosis is not None else []


class CellInterrupted(KeyboardInterrupt):
    """A %%nanwatch cell stopped by Kernel > Interrupt: one line, not a traceback.

    Still a KeyboardInterrupt, so that "Run All" stops at this cell as it would without the
    magic; the FrameBrowser shown above it holds what was recorded until then.
    """

    def __init__(self, name: str, batches: int) -> None:
        self.name = name
        self.batches = batches
        super().__init__(f"%%nanwatch {name} interrupted ({batches} "
                         f"batch{'es' if batches != 1 else ''} seen)")

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}; the FrameBrowser above shows what was recorded "
                "(_nanwatch holds the watch)"]


class CellSyntaxError(SyntaxError):
    """A %%nanwatch cell that does not compile; no watch was started. The extension's handler
    shows it as IPython shows any cell's SyntaxError (the cell's line and a caret), without the
    magic's frames (IPython lists every frame of a SyntaxError raised by running code)."""


def _user_code_line(tb: Any) -> str:
    """Where the user's code called into the model: the innermost frame outside torch, IPython
    and nanwidget."""
    found = traceback_source(tb)
    if found is None:
        return ""
    filename, line = found
    text = linecache.getline(filename, line).strip()
    return f"  raised at {format_source(filename, line)}" + (f": {text}" if text else "")


def show_nan_detected(shell: Any, etype: type, value: BaseException, tb: Any,
                      tb_offset: int | None = None) -> None:
    """IPython custom exception handler: NanDetected as one line and a FrameBrowser
    (AbortAfterBatch, the stop that was asked for, as one line; a %%nanwatch cell's
    SyntaxError as IPython shows a cell's).

    Registered while the extension is loaded, so a line-mode ``%nanwatch`` that raises in a
    later cell reads the same as a ``%%nanwatch`` cell; ``%tb`` still shows the full traceback.
    """
    # What IPython records for any error, so that %tb and %debug find this one.
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    if isinstance(value, CellSyntaxError):
        lines = shell.SyntaxTB.structured_traceback(SyntaxError, value, [])
    elif isinstance(value, AbortAfterBatch):  # the stop a line watch's --abort-after asked for
        lines = [f"AbortAfterBatch: {value}", _user_code_line(tb), "(full traceback: %tb)"]
    elif isinstance(value, NanInCell):
        lines = value._render_traceback_()  # its cell already showed the browser
    else:
        event = value.event  # type: ignore[attr-defined]
        magics = find_magics(shell)
        owner = None
        if magics is not None:
            owner = next((w for w in magics.manager.watches.values()
                          if any(known is event for known in w.events)), None)
        # The watch's browser opens at its first event; a later one (the line watch stopped
        # before, the user fixed it and ran on) gets a browser of its own frames.
        first = owner is not None and owner.events and owner.events[0] is event
        try:
            browser = owner.browse() if first else FrameBrowser(event)
            display(magics.manager.shown(browser) if magics is not None else browser)
        except Exception:  # the message below still says what happened
            pass
        lines = [f"NanDetected: {event.summary()}", *_diagnosis_line(event), _user_code_line(tb),
                 "(full traceback: %tb)"]
    print("\n".join(line for line in lines if line), file=sys.stderr)


# Shown as one line (and a FrameBrowser for a NaN/Inf) instead of a traceback through torch.
_SHOWN_SHORT = (NanDetected, AbortAfterBatch, CellSyntaxError)


def _argument_type(parse: Any) -> Any:
    """An option's text parser as argparse wants it (its ValueError becomes the usage message)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _option_flags(magic: Any) -> Any:
    """Add one ``@argument`` per watch option that has a ``%nanwatch`` flag (declared in
    :mod:`nanwidget.core.options`), in the options' order."""
    for declared in reversed(list(OPTIONS.values())):
        flag = declared.flag
        if flag is None:
            continue
        text = flag.help or declared.help
        if flag.parse is None:
            magic = argument(*flag.names, dest=declared.name, action="store_const",
                             const=flag.value, default=None, help=text)(magic)
        else:
            metavar = flag.metavar or flag.names[-1].lstrip("-").upper().replace("-", "_")
            magic = argument(*flag.names, dest=declared.name, default=None, help=text,
                             type=_argument_type(flag.parse), choices=flag.choices,
                             metavar=metavar)(magic)
    return magic


# Every spelling of each watch option's flag -> its long name (-n and --frames are one).
_FLAG_NAMES = {spelling: declared.flag.names[-1] for declared in OPTIONS.values()
               if declared.flag is not None for spelling in declared.flag.names}


def _refuse_repeated(tokens: list[str]) -> None:
    """An option given twice is a mistake to say, not a value to pick (argparse keeps the
    last: --frames 5 --frames 7 watched with 7)."""
    seen: set[str] = set()
    for token in tokens:
        name = _FLAG_NAMES.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if name is None:
            continue
        if name in seen:
            raise MagicUsageError(f"{name} is given twice; give each option once")
        seen.add(name)


# argparse would list the optional MODEL last; the docs (and users) write it first.
_USAGE = ("%(prog)s MODEL [options]\n"  # IPython's help formatter adds the first "%"
          "       %%%(prog)s --off [MODEL]\n"
          "       %%%(prog)s\n"
          "       %%%%%(prog)s MODEL [options]   (cell magic)")


@magics_class
class NanwatchMagics(Magics):
    """Holds one :class:`WatchManager`; ``%config NanwatchMagics.frames = 50`` sets defaults."""

    frames = Int(OPTIONS["max_frames"].default,
                 help="frames kept in the ring buffer when -n is not given").tag(config=True)
    on_nan = CaselessStrEnum(list(ON_NAN_CHOICES), default_value=OPTIONS["on_nan"].default,
                             help="what a watch does at a NaN/Inf when --on-nan is not given"
                             ).tag(config=True)
    browsers_kept = Int(4, help="FrameBrowsers shown by %nanwatch that stay live; older ones "
                               "are closed (their output keeps its static copy) so that the "
                               "watches, models and batches they show are freed").tag(config=True)
    refresh_seconds = Float(0.3, help="least time between two updates of a %%nanwatch cell's "
                                      "live status line").tag(config=True)

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self.manager = WatchManager(browsers_kept=self.browsers_kept)
        self.owns_custom_exc = False
        self._async_cell_rewriter = make_async_cell_rewriter(shell)

    @observe("browsers_kept")
    def _browsers_kept_changed(self, change: Any) -> None:  # %config NanwatchMagics.browsers_kept
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.browsers_kept = change["new"]

    def attach(self) -> None:
        """Register on the shell: the magics, ``%config NanwatchMagics`` and the one-line
        display of NanDetected."""
        shell = self.shell
        shell.register_magics(self)
        # NanDetected from any cell: one line and the browser. Only when no one else set a handler.
        self.owns_custom_exc = not shell.custom_exceptions
        if self.owns_custom_exc:
            shell.set_custom_exc(_SHOWN_SHORT, show_nan_detected)
        if self not in shell.configurables:
            shell.configurables.append(self)
        # %%nanwatch cells that await at top level run on IPython's event loop, as other cells do.
        shell.input_transformers_cleanup.append(self._async_cell_rewriter)
        # A line watch follows its object: say when the variable that named it is rebound.
        shell.events.register("post_run_cell", self.report_rebound_names)

    def detach(self) -> None:
        """Undo :meth:`attach` and close every watch (every hook any watch added)."""
        shell = self.shell
        names = list(self.manager.watches)
        others = self.manager.close_all() - len(names)
        self.manager.close_browsers()
        if names or others:  # %reload_ext too: say that nothing is watched any more
            stopped = names + ([f"{others} watch{'es' if others != 1 else ''} made with "
                                "nw.watch()"] if others else [])
            print(f"nanwidget: unloaded; stopped watching {', '.join(stopped)}")
        for kind in ("line", "cell"):
            table = shell.magics_manager.magics[kind]
            if getattr(table.get("nanwatch"), "__self__", None) is self:
                del table["nanwatch"]
        shell.magics_manager.registry.pop(type(self).__name__, None)
        if self in shell.configurables:
            shell.configurables.remove(self)
        if self.owns_custom_exc and shell.custom_exceptions == _SHOWN_SHORT:
            shell.set_custom_exc((), None)
        if self._async_cell_rewriter in shell.input_transformers_cleanup:
            shell.input_transformers_cleanup.remove(self._async_cell_rewriter)
        if self.report_rebound_names in shell.events.callbacks["post_run_cell"]:
            shell.events.unregister("post_run_cell", self.report_rebound_names)

    @line_cell_magic
    @magic_arguments()
    @kwds(usage=_USAGE)
    @argument("model", nargs="?", metavar="MODEL",
              help="variable name of the nn.Module (e.g. model or trainer.model)")
    @argument("--off", action="store_true",
              help="stop watching MODEL (every model %%nanwatch watches when MODEL is left out)")
    @_option_flags
    def nanwatch(self, line: str, cell: str | None = None) -> Any:
        """Watch a PyTorch model for the first NaN/Inf.

        Line:  %nanwatch MODEL [options]  start watching; prints one status line.
               %nanwatch --off [MODEL]    stop (all watches when MODEL is left out).
               %nanwatch                  list what is watched.
        Cell:  %%nanwatch MODEL [options] watch while the cell runs, with a live status line;
               at a NaN/Inf the cell stops, the FrameBrowser opens at the event and one line
               says where it happened. The watch stays in the variable _nanwatch.
        A torch.compile'd model is watched in sentinel mode (--sentinel is implied).
        """
        __tracebackhide__ = True  # IPython leaves this frame out of tracebacks from the cell
        try:
            prepared = self._prepare(line, cell)
            if cell is None or prepared is None:
                return None
            name, model, options = prepared
            if self.shell.autoawait and _has_top_level_await(self.shell.transform_cell(cell)):
                return self._run_async_cell_now(name, model, options, cell)
            return self._run_cell(name, model, options, cell)
        except MagicUsageError as error:
            raise UsageError(str(error)) from None

    async def run_async_cell(self, line: str, cell: str) -> Any:
        """A ``%%nanwatch`` cell with top-level ``await``, awaited on IPython's own loop.

        Such cells are rewritten by the input transformer from :func:`make_async_cell_rewriter`
        into ``await <this>(line, cell)``, so IPython runs them as it runs any async cell, in
        Jupyter (on the kernel's loop) and in a terminal.
        """
        __tracebackhide__ = True
        try:
            prepared = self._prepare(line, cell)
            if prepared is None:
                return None
            name, model, options = prepared
            compiled = self._compile(cell, allow_await=True)  # a SyntaxError starts no watch
            watched, live = self._start_cell(name, model, options)
            try:
                result = await self._execute_async(compiled)
            except BaseException as error:
                return self._cell_failed(watched, live, error, name, model)
            return self._cell_done(watched, live, result, name, model)
        except MagicUsageError as error:
            raise UsageError(str(error)) from None

    def _prepare(self, line: str, cell: str | None) -> tuple[str, Any, dict[str, Any]] | None:
        """Parse ``line``; handle --off and the listing; else (name, model, options) to watch."""
        try:
            # Split as a shell does (IPython's default keeps the quotes): --log-dir "runs/a b"
            # names the folder runs/a b, not one whose name starts with a quote.
            raw = arg_split(line, posix=False)  # quotes kept: a quoted '#' is no comment
            comment = next((i for i, t in enumerate(raw) if t.startswith("#")), None)
            if comment is not None:  # a trailing `# ...`, as Python and shells read it
                line = " ".join(raw[:comment])
            tokens = arg_split(line, posix=True)
        except ValueError as error:  # shlex: an unterminated quote
            raise MagicUsageError(f"%nanwatch could not read its options ({error}): {line!r}; "
                                  "check the quotes") from None
        _refuse_repeated(tokens)
        args = self.nanwatch.parser.parse_args(tokens)
        if args.off:
            if cell is not None:
                raise MagicUsageError("--off is for the line magic: %nanwatch --off [MODEL]")
            given = [declared.flag.names[-1] for name, declared in OPTIONS.items()
                     if declared.flag is not None and getattr(args, name) is not None]
            if given:
                raise MagicUsageError(f"--off stops a watch and takes no watch options (got "
                                      f"{', '.join(given)}): %nanwatch --off [MODEL]")
            self._stop(args.model)
            return None
        if args.model is None:
            if cell is not None:
                raise MagicUsageError("%%nanwatch needs a model: %%nanwatch MODEL [options]")
            self._list()
            return None
        magic = "%nanwatch" if cell is None else "%%nanwatch"
        model = self.manager.lookup(self.shell.user_ns, args.model, magic)
        options = self._options(args, magic)
        if cell is None:
            started, replaced = self.manager.start(args.model, model, options)
            self.shell.user_ns["_nanwatch"] = started
            print(("(restarted) " if replaced else "") + self.manager.describe(args.model, started))
            return None
        return args.model, model, options

    # ------------------------------------------------------------------ translation
    def _options(self, args: argparse.Namespace, magic: str = "%nanwatch") -> dict[str, Any]:
        """The watch options the flags name (the flags are declared with the options)."""
        options = {name: getattr(args, name) for name, declared in OPTIONS.items()
                   if declared.flag is not None and getattr(args, name) is not None}
        for name, value in options.items():
            flag = OPTIONS[name].flag
            if flag is not None and flag.lookup:  # a variable of the notebook, found by name
                options[name] = self.manager.lookup_value(self.shell.user_ns, value,
                                                          flag.names[-1], magic=magic)
        for name, declared in OPTIONS.items():
            needs = declared.needs
            if name in options and needs is not None and options.get(needs.option) != needs.value:
                needed = OPTIONS[needs.option].flag
                raise MagicUsageError(f"{declared.flag.names[-1]} is for {needs.words}: add "
                                      f"{needed.names[-1] if needed else needs.option}")
        # %config NanwatchMagics.frames / .on_nan: defaults for flags left out.
        options.setdefault("max_frames", self.frames)
        options.setdefault("on_nan", self.on_nan)
        return options

    def _stop(self, name: str | None) -> None:
        stopped = self.manager.stop(name, self.shell.user_ns)
        print(f"nanwidget: stopped watching {', '.join(stopped)}" if stopped
              else "nanwidget: nothing was being watched")

    def _list(self) -> None:
        if not self.manager.watches:
            print("nanwidget: not watching anything; start with %nanwatch MODEL")
        for name, watched in self.manager.watches.items():
            print(f"{name}: {watched!r}")

    def _run_cell(self, name: str, model: Any, options: dict[str, Any], cell: str) -> Any:
        __tracebackhide__ = True
        compiled = self._compile(cell, allow_await=False)  # a SyntaxError starts no watch
        watched, live = self._start_cell(name, model, options)
        try:
            result = self._execute(compiled)
        except BaseException as error:
            return self._cell_failed(watched, live, error, name, model)
        return self._cell_done(watched, live, result, name, model)

    def _run_async_cell_now(self, name: str, model: Any, options: dict[str, Any], cell: str) -> Any:
        """An async cell that reached the magic directly (not through the input transformer)."""
        __tracebackhide__ = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise MagicUsageError("this %%nanwatch cell awaits at top level, but it was called while "
                                  "an event loop runs (run_cell_magic from code?); start the cell "
                                  "with %%nanwatch instead")
        compiled = self._compile(cell, allow_await=True)
        watched, live = self._start_cell(name, model, options)
        try:
            result = self.shell.loop_runner(self._execute_async(compiled))
        except BaseException as error:
            return self._cell_failed(watched, live, error, name, model)
        return self._cell_done(watched, live, result, name, model)

    def _start_cell(self, name: str, model: Any, options: dict[str, Any]) -> tuple[Any, LiveStatus]:
        watched = self.manager.make_watch(model, options, name)
        self.shell.user_ns["_nanwatch"] = watched
        handle = display({"text/plain": f"nanwatch {name}: starting"}, raw=True, display_id=True)

        def emit(text: str) -> None:
            if handle is not None:
                handle.update({"text/plain": text}, raw=True)

        live = LiveStatus(name, emit, interval=self.refresh_seconds,
                          sentinel=watched.parts.sentinel,
                          early_warnings=lambda: watched.warnings)
        watched.add_feature(live)
        return watched, live

    def _cell_failed(self, watched: Any, live: LiveStatus, error: BaseException, name: str,
                     model: Any) -> None:
        """The cell raised: close the watch, say how it ended; re-raise (an abort returns None)."""
        __tracebackhide__ = True
        self._print_rebound(self._close_noting_rebound(watched, name, model))
        if isinstance(error, NanDetected):
            live.finish("stopped at a NaN/Inf")
            self._show_browser(watched)
            raise NanInCell(error.event) from None
        if isinstance(error, AbortAfterBatch):
            live.finish("stopped")
            print(f"nanwidget: stopped after batch {error.batch}, as --abort-after asked")
            return None
        if isinstance(error, KeyboardInterrupt):
            # Kernel > Interrupt is not an error: the status line says so, the browser shows
            # what was recorded, one line replaces the traceback through this module.
            live.finish("interrupted")
            self._show_browser(watched)
            raise CellInterrupted(live.name, live.batches) from None
        live.finish("ended by an error")
        raise error

    def _cell_done(self, watched: Any, live: LiveStatus, result: Any, name: str,
                   model: Any) -> Any:
        rebound = self._close_noting_rebound(watched, name, model)
        live.finish()
        self._print_rebound(rebound)
        if watched.events:
            print("\n".join([f"nanwidget: {len(watched.events)} NaN/Inf event(s); first: "
                             f"{watched.event.summary()}", *_diagnosis_line(watched.event)]),
                  file=sys.stderr)
            self._show_browser(watched)
        return result

    def _close_noting_rebound(self, watched: Any, name: str, model: Any) -> str:
        """Close the cell's watch; return the sentence saying that the cell rebound the
        variable it watched (the watch saw the old model), or "". That sentence stands for the
        watch's own "checked nothing" warning at close, which says the same without the
        variable's name: that one is not issued then."""
        sentence = self.manager.rebound_in_cell(self.shell.user_ns, name, model)
        with warnings.catch_warnings():
            if sentence:
                warnings.filterwarnings("ignore", message="nanwidget: This watch checked nothing")
            watched.close()
        return sentence

    @staticmethod
    def _print_rebound(sentence: str) -> None:
        if sentence:
            print(sentence)

    def report_rebound_names(self, result: Any = None) -> None:
        """After each cell (IPython's post_run_cell): say when a watched variable was rebound."""
        for sentence in self.manager.rebound_names(self.shell.user_ns):
            print(sentence)

    def _show_browser(self, watched: Any) -> None:
        try:
            display(self.manager.shown(watched.browse()))
        except Exception as error:  # the one-line message must still reach the user
            print(f"nanwidget: could not show the FrameBrowser ({type(error).__name__}: {error}); "
                  "_nanwatch.report() has the frames", file=sys.stderr)

    def _compile(self, cell: str, allow_await: bool) -> tuple[Any, Any, dict[str, Any]]:
        """The cell's statements and its final expression (or None), compiled for the user
        namespace; with ``allow_await`` top-level ``await`` is allowed (such code objects
        are coroutines), otherwise it is a SyntaxError as in plain Python."""
        shell = self.shell
        # A file name IPython's line cache knows, under this cell's number, so that tracebacks
        # (a SyntaxError's too) read "Cell In[5], line 3"; the leading newline stands for the
        # %%nanwatch line, so that line numbers match the cell as the user sees it.
        source = "\n" + shell.transform_cell(cell)
        filename = shell.compile.cache(source, _running_cell_number(shell))
        flags = _TOP_LEVEL_AWAIT if allow_await else 0
        try:
            tree = ast.parse(source, filename)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            body = compile(tree, filename, "exec", flags=flags)
            final = compile(last, filename, "eval", flags=flags) if last is not None else None
        except SyntaxError as error:
            raise CellSyntaxError(error.msg, (error.filename, error.lineno, error.offset,
                                              error.text, error.end_lineno,
                                              error.end_offset)) from None
        return body, final, shell.user_ns

    def _execute(self, compiled: tuple[Any, Any, dict[str, Any]]) -> Any:
        """Run the cell (:meth:`_compile`'s) in the user namespace; return the value of a final
        expression."""
        __tracebackhide__ = True
        body, final, namespace = compiled
        exec(body, namespace)
        return eval(final, namespace) if final is not None else None

    async def _execute_async(self, compiled: tuple[Any, Any, dict[str, Any]]) -> Any:
        """:meth:`_execute` for a cell with top-level ``await``."""
        __tracebackhide__ = True
        body, final, namespace = compiled
        result = eval(body, namespace)
        if inspect.iscoroutine(result):
            await result
        if final is None:
            return None
        value = eval(final, namespace)
        return await value if final.co_flags & inspect.CO_COROUTINE else value


# IPython's help formatter starts the usage with "::" (reStructuredText, for its own docs); in
# %nanwatch? that is noise.
NanwatchMagics.nanwatch.__doc__ = NanwatchMagics.nanwatch.__doc__.replace("::\n\n  %", "%", 1)


def _running_cell_number(shell: Any) -> int:
    """The number IPython gave the cell now running (its In[N]).

    Not ``shell.execution_count``: IPython 9.18 counts a cell before running it (the count
    then names the next cell), IPython 8 after. The running cell's ExecutionResult holds its
    number on both; it is there only while ``run_cell`` runs a cell, hence the count outside.
    """
    running = getattr(shell.displayhook, "exec_result", None)
    number = getattr(running, "execution_count", None)
    return number if number is not None else shell.execution_count


_TOP_LEVEL_AWAIT = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
_CELL_MAGIC_LINE = re.compile(r"^%%nanwatch(?:\s+(?P<line>.*))?$")


def _has_top_level_await(source: str) -> bool:
    """Whether ``source`` (plain Python) awaits at top level, as IPython decides it."""
    try:
        code = compile(source, "<cell>", "exec", flags=_TOP_LEVEL_AWAIT)
    except (SyntaxError, ValueError):
        return False  # the normal path reports it
    return bool(code.co_flags & inspect.CO_COROUTINE)


def make_async_cell_rewriter(shell: Any) -> Any:
    """An input transformer for ``shell``: a ``%%nanwatch`` cell that awaits at top level
    becomes one ``await`` of :meth:`NanwatchMagics.run_async_cell`, which IPython runs on its
    own event loop (the kernel's in Jupyter). Other cells pass through unchanged."""

    def rewrite_async_cell(lines: list[str]) -> list[str]:
        if not lines or not shell.autoawait:
            return lines
        match = _CELL_MAGIC_LINE.match(lines[0].rstrip())
        if match is None:
            return lines
        body = "".join(lines[1:])
        try:
            if not _has_top_level_await(shell.transform_cell(body)):
                return lines
        except Exception:  # IPython reports its own transform errors on the normal path
            return lines
        line = match.group("line") or ""
        return [f"await get_ipython().find_cell_magic('nanwatch').__self__.run_async_cell"
                f"({line!r}, {body!r})\n"]

    return rewrite_async_cell
