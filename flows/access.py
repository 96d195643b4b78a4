"""A server that refused a request for want of credentials, said as what to set (`omni` prints it).

The clients take their credentials from the environment, by the servers' own names: Prefect
`PREFECT_API_AUTH_STRING` (the server's `PREFECT_SERVER_API_AUTH_STRING`), MLflow
`MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD` (or `MLFLOW_TRACKING_TOKEN`), Ray
`RAY_AUTH_TOKEN` with `RAY_AUTH_MODE=token`, S3 `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`.
"""

from __future__ import annotations

import os


def refused(exc: BaseException) -> str | None:
    """What to set, when `exc` (or what caused it) is a server's 401/403; else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        if status in (401, 403) and "/api/" in str(getattr(getattr(response, "request", None), "url", "")):
            url = os.environ.get("PREFECT_API_URL", "the Prefect API")
            return (f"{url} refused the request ({status}): set PREFECT_API_AUTH_STRING=USER:PASSWORD "
                    "(the server's PREFECT_SERVER_API_AUTH_STRING)")
        if getattr(exc, "error_code", None) in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return (f"the MLflow server refused the request ({exc.error_code}): set MLFLOW_TRACKING_USERNAME "
                    "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to an MLflow user's")
        exc = exc.__cause__ or exc.__context__
    return None
