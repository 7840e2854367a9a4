"""The onceflow view: a FastAPI app that Airflow's api-server mounts at ``/onceflow``.

Routes (under the mount):

=========================================================  ======================================
``GET  /``                                                 page: every pipeline at a glance
``GET  /pipelines/{name}``                                 page: one pipeline (timeline, open
                                                           txids, lag, backflow, dead letters)
``GET  /api/pipelines``                                    JSON: the overview
``GET  /api/pipelines/{name}``                             JSON: one pipeline (``?all_dead=1``:
                                                           every dead letter)
``GET  /api/pipelines/{name}/timeline``                    JSON: a page of the commit timeline
                                                           (``before``/``after`` a txid,
                                                           ``min_txid``, ``max_txid``, ``state``,
                                                           ``limit``), with each txid's runs and
                                                           the paths of its tasks' logs
``GET  /api/pipelines/{name}/series``                      JSON: per committed txid, what the
                                                           charts plot (``last``, ``min_txid``,
                                                           ``max_txid``)
``GET  /api/pipelines/{name}/txid?run_id=R``               JSON: the txid of an Airflow run
``GET  /static/{file}``                                    the React view's module (the
                                                           ``react_apps`` bundle), no login
``POST /api/pipelines/{name}/dead-letters/replay``         put dead letters back in the backflow
``POST /api/pipelines/{name}/dead-letters/request-approval``  ask a person to approve a replay
                                                           (a pipeline with
                                                           ``dead_letter_approval``)
``POST /api/pipelines/{name}/backfill``                    one DAG run per open txid
=========================================================  ======================================

Authentication is Airflow's own: the JWT of the UI's session cookie (or an
``Authorization: Bearer`` token from ``POST /auth/token``), checked by Airflow's
``get_user``; an anonymous request gets 401 (a page redirects to the login). Authorisation is
the auth manager's, on the pipeline's DAG (``onceflow_<name>``) as for its runs: reading
needs ``GET`` on its DAG runs, the actions ``POST`` on them (what triggering a run needs).
A user without it sees no buttons, and the endpoints refuse (403).

A pipeline declared with ``dead_letter_approval=True`` replays dead letters only after a
person approves: for it the replay endpoint refuses (409, naming the way), and the page's
Replay buttons ask for the approval instead: a run of its DAG
``onceflow_<name>_replay_dead_letters`` (``onceflow.airflow.approval``) with the same choice,
which shows the letters in Airflow's Required actions and replays them only once approved.
Asking takes the permission to trigger that DAG.

The actions take two steps: a POST with ``"confirm": false`` says what would happen (the
page shows it in a confirmation dialog), the same POST with ``"confirm": true`` does it. They
need the header ``X-Requested-By`` (a cross-site form cannot send it) and a JSON body.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib.resources import files
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from jinja2 import Environment, FileSystemLoader, select_autoescape
from pydantic import BaseModel, Field

from onceflow.airflow.ui import bundle, data
from onceflow.core import txlog
from onceflow.core.errors import ConfigError, Unavailable, Unreachable

log = logging.getLogger(__name__)

MOUNT = "/onceflow"
_bearer = HTTPBearer(auto_error=False)
_SECURITY_HEADERS = {
    "X-Frame-Options": "SAMEORIGIN",
    "Content-Security-Policy": "frame-ancestors 'self'",
    "Cache-Control": "no-store",
}


# -- authentication and authorisation (Airflow's own) ---------------------------------------------
async def _user_or_none(
        request: Request,
        bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]):
    # imported here: Airflow's own modules: the UI plugin is loaded while Airflow starts
    from airflow.api_fastapi.core_api.security import get_user

    try:
        return await get_user(request, None, bearer)
    except HTTPException:
        return None


MaybeUser = Annotated[Any, Depends(_user_or_none)]


async def _user(user: MaybeUser):
    if user is None:
        raise HTTPException(401, "Not authenticated: log in to Airflow (or send a bearer token "
                                 "from POST /auth/token)")
    return user


User = Annotated[Any, Depends(_user)]


def allowed(user, pipeline: str, method: str) -> bool:
    """Whether ``user`` may ``GET`` (read) or ``POST`` (act on) the runs of ``pipeline``'s
    DAG, by Airflow's auth manager."""
    return allowed_dag(user, data.dag_id_of(pipeline), method)


def allowed_dag(user, dag_id: str, method: str) -> bool:
    """Whether ``user`` may ``GET`` (read) or ``POST`` (trigger) the runs of ``dag_id``, by
    Airflow's auth manager."""
    # imported here: Airflow's own modules: the UI plugin is loaded while Airflow starts
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        DagAccessEntity,
        DagDetails,
    )
    from airflow.models.dag import DagModel

    try:
        team = DagModel.get_team_name(dag_id)
    except Exception:  # no team tables to ask: no team
        team = None
    return get_auth_manager().is_authorized_dag(
        method=method, access_entity=DagAccessEntity.RUN,
        details=DagDetails(id=dag_id, team_name=team), user=user)


def _pipeline(name: str, user, method: str = "GET"):
    known = _registered()
    if name not in known or not allowed(user, name, "GET"):
        # only the names this user may read: the others stay unknown to them
        visible = [n for n in known if allowed(user, n, "GET")]
        raise HTTPException(404, f"no pipeline {name!r} here: known pipelines are "
                                 f"{', '.join(visible) or 'none'}")
    if method != "GET" and not allowed(user, name, method):
        raise HTTPException(403, f"{user.get_name()} may not operate pipeline {name!r}: it "
                                 f"takes the permission to trigger runs of DAG "
                                 f"{data.dag_id_of(name)}")
    return known[name]


def _may_request(user, pipeline) -> bool:
    """Whether ``user`` may ask for an approved replay of ``pipeline``'s dead letters."""
    return bool(pipeline.dead_letter_approval) and allowed_dag(
        user, data.approval_dag_id(pipeline.name), "POST")


def _registered() -> dict[str, Any]:
    try:
        return data.registered()
    except ConfigError as error:
        raise HTTPException(500, f"onceflow cannot load its pipelines: {error}") from error


def _visible(user) -> list:
    return [p for name, p in _registered().items() if allowed(user, name, "GET")]


def _guard_post(request: Request) -> None:
    """Actions come from onceflow's page (or a script that says so), never a cross-site form."""
    if not request.headers.get("x-requested-by"):
        raise HTTPException(400, "send the header X-Requested-By (any value) with actions")


def _failure(error: Exception) -> HTTPException:
    if isinstance(error, Unreachable | Unavailable | ConfigError):
        return HTTPException(503, str(error))
    return HTTPException(500, f"{type(error).__name__}: {error}")


# -- pages ----------------------------------------------------------------------------------------
def _templates():
    folder = files("onceflow.airflow.ui") / "templates"
    env = Environment(loader=FileSystemLoader(str(folder)), autoescape=select_autoescape(),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = lambda v: "-" if v is None else f"{v:,}"
    env.filters["secs"] = lambda v: "-" if v is None else f"{v:.1f}s"
    env.filters["when"] = lambda v: (v or "-").replace("T", " ").replace("+00:00", "Z")
    return env


_env = None


def _page(request: Request, template: str, status_code: int = 200, **values) -> HTMLResponse:
    global _env
    if _env is None:
        _env = _templates()
    root = request.scope.get("root_path", "").removesuffix(MOUNT)
    html = _env.get_template(template).render(
        base=f"{root}{MOUNT}", airflow=root or "", **values)
    return HTMLResponse(html, status_code=status_code, headers=_SECURITY_HEADERS)


def _error_page(request: Request, user, error: HTTPException) -> HTMLResponse:
    """The error page, answered with the error's own status (a 404 is a 404 to a script)."""
    return _page(request, "error.html", error.status_code, user=user, error=error.detail)


def _login(request: Request) -> RedirectResponse:
    # imported here: Airflow's own modules: the UI plugin is loaded while Airflow starts
    from airflow.api_fastapi.app import get_auth_manager

    return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)),
                            status_code=307)


def create_app() -> FastAPI:
    app = FastAPI(title="onceflow", description=__doc__, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request, user: MaybeUser):
        if user is None:
            return _login(request)
        try:
            rows = [data.summary(p) for p in _visible(user)]
        except HTTPException as error:
            return _error_page(request, user, error)
        except Exception as error:
            return _error_page(request, user, _failure(error))
        return _page(request, "index.html", user=user, pipelines=rows)

    @app.get("/pipelines/{name}", response_class=HTMLResponse, include_in_schema=False)
    def pipeline_page(name: str, request: Request, user: MaybeUser, all_dead: bool = False):
        if user is None:
            return _login(request)
        try:
            pipeline = _pipeline(name, user)
            view = data.pipeline_view(pipeline, all_dead=all_dead)
        except HTTPException as error:
            return _error_page(request, user, error)
        except Exception as error:
            return _error_page(request, user, _failure(error))
        return _page(request, "pipeline.html", user=user, p=view,
                     can_operate=allowed(user, name, "POST"),
                     can_request=_may_request(user, pipeline))

    @app.get("/api/pipelines")
    def api_pipelines(user: User) -> list[dict[str, Any]]:
        try:
            return [data.summary(p) for p in _visible(user)]
        except HTTPException:
            raise
        except Exception as error:
            raise _failure(error) from error

    @app.get("/api/pipelines/{name}")
    def api_pipeline(name: str, user: User, all_dead: bool = False) -> dict[str, Any]:
        pipeline = _pipeline(name, user)
        try:
            view = data.pipeline_view(pipeline, all_dead=all_dead)
        except Exception as error:
            raise _failure(error) from error
        return {**view, "can_operate": allowed(user, name, "POST"),
                "can_request_approval": _may_request(user, pipeline)}

    @app.get("/api/pipelines/{name}/timeline")
    def api_timeline(
            name: str, user: User,
            before: Annotated[int | None, Query(ge=1)] = None,
            after: Annotated[int | None, Query(ge=0)] = None,
            min_txid: Annotated[int | None, Query(ge=1)] = None,
            max_txid: Annotated[int | None, Query(ge=1)] = None,
            state: Annotated[list[str], Query()] = (),
            limit: Annotated[int, Query(ge=1, le=data.PAGE_MAX)] = data.TIMELINE,
    ) -> dict[str, Any]:
        pipeline = _pipeline(name, user)
        if before is not None and after is not None:
            raise HTTPException(400, "give before or after, not both: before=N pages to older "
                                     "txids, after=N to newer ones")
        if min_txid is not None and max_txid is not None and min_txid > max_txid:
            raise HTTPException(400, f"min_txid={min_txid} is above max_txid={max_txid}: "
                                     "give the lower txid as min_txid")
        states = _states(state)
        try:
            return data.timeline(pipeline, before=before, after=after, min_txid=min_txid,
                                 max_txid=max_txid, states=states, limit=limit)
        except Exception as error:
            raise _failure(error) from error

    @app.get("/api/pipelines/{name}/series")
    def api_series(
            name: str, user: User,
            last: Annotated[int, Query(ge=1, le=data.SERIES_MAX)] = data.SERIES,
            min_txid: Annotated[int | None, Query(ge=1)] = None,
            max_txid: Annotated[int | None, Query(ge=1)] = None,
    ) -> dict[str, Any]:
        pipeline = _pipeline(name, user)
        try:
            return data.series(pipeline, last=last, min_txid=min_txid, max_txid=max_txid)
        except Exception as error:
            raise _failure(error) from error

    @app.get("/api/pipelines/{name}/txid")
    def api_txid_of_run(name: str, user: User,
                        run_id: Annotated[str, Query(min_length=1, max_length=250)]
                        ) -> dict[str, Any]:
        pipeline = _pipeline(name, user)
        try:
            txid = data.txid_of_run(pipeline.name, run_id)
        except Exception as error:
            raise _failure(error) from error
        if txid is None:
            raise HTTPException(404, f"run {run_id!r} of {data.dag_id_of(pipeline.name)} has "
                                     "no txid: it planned no transaction (see its begin "
                                     "task's log)")
        return {"pipeline": pipeline.name, "run_id": run_id, "txid": txid}

    @app.get("/static/{file}", include_in_schema=False)
    def static(file: str, request: Request):
        # The React view's module: code without data, so no login. Asked for with its
        # digest (the plugin's bundle_url), a browser may keep it: a new version has another.
        body = bundle.read(file)
        if body is None:
            raise HTTPException(404, f"no file {file!r} among the onceflow view's static files")
        version = request.query_params.get("v")
        cache = ("public, max-age=31536000, immutable" if version == bundle.digest(file)
                 else "no-cache")
        return Response(body, media_type="text/javascript; charset=utf-8",
                        headers={"Cache-Control": cache, "X-Content-Type-Options": "nosniff"})

    @app.post("/api/pipelines/{name}/dead-letters/replay")
    def api_replay(name: str, body: ReplayBody, request: Request,
                   user: User) -> dict[str, Any]:
        _guard_post(request)
        pipeline = _pipeline(name, user, "POST")
        if pipeline.dead_letter_approval:
            approval = data.approval_dag_id(pipeline.name)
            raise HTTPException(409, (
                f"pipeline {pipeline.name!r} replays dead letters only after a person approves "
                f"(dead_letter_approval): ask for the approval instead (POST "
                f"{MOUNT}/api/pipelines/{pipeline.name}/dead-letters/request-approval, the "
                f"page's buttons), or trigger the DAG {approval} with the same choice"))
        choice = body.choice()
        try:
            count = data.replay_dead_letters(pipeline.name, choice, apply=body.confirm)
        except Exception as error:
            raise _failure(error) from error
        if not body.confirm:
            return {"confirm": False, "count": count, "message": (
                f"Put {count} dead letter(s) of {pipeline.name} ({choice.describe()}) back in "
                "the backflow from-queue? The next transactions replay them, "
                f"{pipeline.max_replays} more time(s) at most.")}
        log.warning("REPLAY by %s in the onceflow view: %d dead letter(s) of %s (%s)",
                    user.get_name(), count, pipeline.name, choice.describe())
        return {"confirm": True, "count": count, "message": (
            f"{count} dead letter(s) of {pipeline.name} put back in the backflow from-queue: "
            "the next transactions replay them.")}

    @app.post("/api/pipelines/{name}/dead-letters/request-approval")
    def api_request_approval(name: str, body: ReplayBody, request: Request,
                             user: User) -> dict[str, Any]:
        _guard_post(request)
        pipeline = _pipeline(name, user)
        dag_id = data.approval_dag_id(pipeline.name)
        if not pipeline.dead_letter_approval:
            raise HTTPException(409, (
                f"pipeline {pipeline.name!r} does not ask for approvals of replays (no "
                f"dead_letter_approval): replay with POST "
                f"{MOUNT}/api/pipelines/{pipeline.name}/dead-letters/replay"))
        if not allowed_dag(user, dag_id, "POST"):
            raise HTTPException(403, f"{user.get_name()} may not ask for a replay of "
                                     f"{pipeline.name!r}: it takes the permission to trigger "
                                     f"runs of DAG {dag_id}")
        choice = body.choice()
        paused = data.dag_paused(dag_id)
        if paused is None:
            raise HTTPException(404, (
                f"Airflow has no DAG {dag_id}: its DAG file must load (transaction_dags() "
                f"gives it to a pipeline with dead_letter_approval, or call "
                f"replay_dead_letters_dag({pipeline.name!r}) in a DAG file)"))
        try:
            count = data.replay_dead_letters(pipeline.name, choice, apply=False)
        except Exception as error:
            raise _failure(error) from error
        note = (f" The DAG {dag_id} is paused: unpause it for the request to be made."
                if paused else "")
        if not body.confirm or count == 0:
            return {"confirm": False, "count": count, "message": (
                f"Ask a person to approve a replay of {count} dead letter(s) of "
                f"{pipeline.name} ({choice.describe()})? A run of {dag_id} shows them in "
                "Airflow's Required actions; nothing is replayed unless it is approved."
                f"{note}" if count else
                f"No dead letter of {pipeline.name} is {choice.describe()}: nothing to ask.")}
        try:
            run = data.trigger_approval(pipeline.name, choice, user.get_name())
        except Exception as error:
            raise _failure(error) from error
        log.warning("REPLAY REQUEST by %s in the onceflow view: %d dead letter(s) of %s (%s): "
                    "run %s of %s", user.get_name(), count, pipeline.name, choice.describe(),
                    run, dag_id)
        return {"confirm": True, "count": count, "dag_id": dag_id, "run_id": run,
                "message": (
                    f"Asked for an approval: run {run} of {dag_id} shows {count} dead "
                    "letter(s) in Airflow's Required actions; they are replayed once a person "
                    f"approves.{note}")}

    @app.post("/api/pipelines/{name}/backfill")
    def api_backfill(name: str, body: BackfillBody, request: Request,
                     user: User) -> dict[str, Any]:
        _guard_post(request)
        pipeline = _pipeline(name, user, "POST")
        try:
            todo = data.open_transactions(pipeline.name)
        except Exception as error:
            raise _failure(error) from error
        if body.txids is not None:
            todo = [t for t in todo if t["txid"] in set(body.txids)]
        txids = [t["txid"] for t in todo]
        dag_id = data.dag_id_of(pipeline.name)
        paused = data.dag_paused(dag_id)
        if paused is None:
            raise HTTPException(404, f"Airflow has no DAG {dag_id}: its DAG file must load "
                                     "before its transactions can be backfilled")
        note = (f" The DAG {dag_id} is paused: unpause it for the runs to start."
                if paused else "")
        if not body.confirm:
            listing = "; ".join(f"txid {t['txid']} ({t['state']}, attempt {t['attempt']}: "
                                f"{t['reason'] or '-'})" for t in todo)
            return {"confirm": False, "txids": txids, "message": (
                f"Trigger {len(txids)} run(s) of {dag_id}, one per txid, in txid order: "
                f"{listing}?{note}" if txids else
                f"{pipeline.name} has no failed, superseded or abandoned transaction.")}
        if not txids:
            return {"confirm": True, "txids": [], "runs": [], "message":
                    f"{pipeline.name} has no failed, superseded or abandoned transaction."}
        try:
            runs = data.trigger_backfill(pipeline.name, txids, user.get_name())
        except Exception as error:
            raise _failure(error) from error
        log.warning("BACKFILL by %s in the onceflow view: %s txids %s", user.get_name(),
                    pipeline.name, txids)
        return {"confirm": True, "txids": txids, "runs": runs, "message": (
            f"Triggered {len(runs)} run(s) of {dag_id}: " + ", ".join(
                f"txid {r['txid']} ({r['run_id']})" for r in runs) + "." + note)}

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, error: RequestValidationError):
        # one sentence naming each field and the value given, not pydantic's structure
        problems = []
        for item in error.errors():
            field = ".".join(str(p) for p in item.get("loc", ())[1:]) or "the request"
            given = item.get("input")
            value = ("" if given is None or isinstance(given, dict)
                     else f"={given}" if isinstance(given, str) else f"={given!r}")
            problems.append(f"{field}{value}: {item.get('msg', 'invalid')}")
        return JSONResponse({"detail": "; ".join(problems)}, status_code=400,
                            headers=_SECURITY_HEADERS)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException):
        return JSONResponse({"detail": error.detail}, status_code=error.status_code,
                            headers={**_SECURITY_HEADERS, **(error.headers or {})})

    return app


def _states(given: Iterable[str]) -> list[str]:
    """``state`` values (repeated, or comma-separated), each a state the timeline shows."""
    states = [s.strip() for value in given for s in value.split(",") if s.strip()]
    wrong = [s for s in states if s not in txlog.PAGE_STATES]
    if wrong:
        raise HTTPException(400, f"state={wrong[0]!r} is not a transaction state: choose from "
                                 f"{', '.join(txlog.PAGE_STATES)}")
    return list(dict.fromkeys(states))


class ReplayBody(BaseModel):
    """Which dead letters: ``records`` ("PARTITION:OFFSET"), ``error_contains`` (a text of
    any of their errors), ``last_error`` (their whole last error, one reason of the page's
    list), or ``all``."""

    records: list[str] | None = None
    error_contains: str | None = Field(None, min_length=1, max_length=2000)
    last_error: str | None = Field(None, min_length=1, max_length=100_000)
    all: bool = False
    confirm: bool = False

    def choice(self) -> data.Choice:
        positions = None
        if self.records is not None:
            positions = []
            for item in self.records:
                partition, _, offset = item.partition(":")
                if not (partition.isdigit() and offset.isdigit()):
                    raise HTTPException(400, f"record {item!r} is not PARTITION:OFFSET")
                positions.append((int(partition), int(offset)))
            positions = tuple(positions)
        narrower = (positions, self.error_contains, self.last_error)
        if all(c is None for c in narrower) and not self.all:
            raise HTTPException(400, "choose the dead letters: records, error_contains, "
                                     "last_error or all")
        if self.all and any(c is not None for c in narrower):
            raise HTTPException(400, "all excludes records, error_contains and last_error")
        return data.Choice(positions, self.error_contains, self.all, self.last_error)


class BackfillBody(BaseModel):
    """``txids``: only these of the open transactions (default: every one)."""

    txids: list[int] | None = None
    confirm: bool = False
