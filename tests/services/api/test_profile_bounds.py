"""The admin API refuses unbounded job limits with a 422 naming the field."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.services.api.support import ADMIN, create_loop


def test_create_and_patch_refuse_unbounded_job_limits(client: TestClient) -> None:
    response = client.post(
        "/v1/loops",
        json={
            "name": "huge",
            "environment": "toolcalc",
            "training_profile": {"timeout_s": 30 * 86_400, "nodes": 512, "accelerators": 8},
        },
        headers=ADMIN,
    )
    assert response.status_code == 422, response.text
    paths = {f["path"] for f in response.json()["error"]["fields"]}
    assert paths == {"training_profile.timeout_s", "training_profile.accelerators"}
    create_loop(client, "fits")
    patched = client.patch(
        "/v1/loops/fits", json={"training_profile": {"timeout_s": 1e9}}, headers=ADMIN
    )
    assert patched.status_code == 422
    (field,) = patched.json()["error"]["fields"]
    assert field["path"] == "training_profile.timeout_s"
    assert "7 days" in field["message"]
